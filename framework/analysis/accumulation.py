"""The memory traffic of a step's gradient accumulation, which the planner prices at the
device's memory bandwidth (`planner.predict_time`'s `accumulate` term).

With several microbatches a step's gradients are sums: each microbatch's weight
gradients, in the compute dtype, are added into accumulators in the stored dtype
(`optim.param_dtype`): the accumulators read and written, the update read, per element
2 x stored + compute bytes (float32 sums of bfloat16 gradients: 10 bytes, 2.5x the
accumulators' bytes). No FLOP to speak of, so the compute rate does not cover it; at a
few GiB of accumulators over dozens of microbatches it is 1-8% of a pipelined step.

    tick executor   (1F1B family, zero-bubble) each microbatch's backward adds each of a
                    rank's chunks once: m x the chunks' accumulators, and the head's on
                    the last stage (`executor_state`'s `accumulators`: measured from the
                    executor's own carry). Not the embedding's: its rows are
                    scatter-added, the touched rows only (`traffic.py`). With the GPU
                    compiler before jaxlib 0.11.2 (`hardware.passes_through`) the adds
                    run outside the cells' conditionals, adding zeros on the ticks a
                    chunk's backward does not run: more than priced here.
    autodiff        (GPipe, circular) the transposed tick loop adds the weights'
                    cotangents every tick, busy or not: the forward table's ticks x a
                    chunk's accumulators, and the head's m times.
    no pipeline     m > 1 microbatches accumulated (`autodiff.accumulates`): all of the
                    device's parameters' gradients m times; m = 1: nothing to add.

The compiled program's own figure is `framework.compile`'s
`traffic/accumulated_bytes_per_step` (the kernels of the `accumulate` scope);
tests/compiled/test_accumulation.py holds this count to it.
"""

from __future__ import annotations

import math

import numpy as np

from framework.analysis.executor_state import executor_state
from framework.units import FP32


def accumulated_bytes(lay, stored_dtype: str = "float32", platform: str | None = None) -> float:
    """Bytes per device per step the gradient accumulation of layout `lay` reads and
    writes (see the module docstring): the accumulators' bytes times how often they are
    added to, times (2 + compute / stored bytes); `stored_dtype`: optim.param_dtype."""
    sched, m = lay.program.schedule, lay.program.schedule.n_microbatches
    if m == 1 and lay.parallel.pipeline == 1:
        return 0.0
    stored = np.dtype(stored_dtype).itemsize
    per_element = 2 + np.dtype(lay.model.dtype).itemsize / stored
    if lay.parallel.pipeline == 1:
        return _all_gradients(lay) * stored / FP32 * m * per_element
    state = executor_state(lay.model, lay.parallel, lay.global_batch, lay.seq_len, platform)
    # (traced in float32 accumulators: the stored dtype's share of them)
    chunks, head = (b * stored / FP32 for b in state["accumulators"])
    if lay.program.autodiff:
        ticks = len(lay.program.scan_inputs()["kind"])
        return (chunks / sched.n_chunks * ticks + head * m) * per_element
    return (chunks + head) * m * per_element


def _all_gradients(lay) -> float:
    """float32 bytes of one device's parameter gradients without a pipeline, less the
    embedding's (scatter-added rows) unless the head is the embedding: sharded over
    `data` where FSDP gathers per use (each microbatch's gradient reduce-scattered)."""
    from framework.analysis.memory_model import param_bytes

    w = param_bytes(lay)
    total = w.stored if lay.gathers_per_use else w.full
    if lay.model.tie_embeddings:
        return total
    embed = math.prod((lay.model.vocab_size, lay.model.d_model)) * FP32
    ways = lay.parallel.tensor * (lay.parallel.data if lay.gathers_per_use else 1)
    return total - embed / ways
