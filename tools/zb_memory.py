"""What a zero-bubble W that does not recompute would hold, under full remat.

    python tools/zb_memory.py llama3_8b llama3_70b

Under `parallel.remat=full` ZB-H1's W recomputes the chunk's forward and input gradient
to get its weight ops' inputs and output gradients (12N FLOPs per token per parameter
against 1F1B's 8N). The alternative, B keeping them for W, holds per pending
microbatch-chunk what this tool measures from the program (the tick executor's traced
types, `jax.eval_shape`, no devices): the weight ops' inputs (`saved`) and output
gradients (`douts`) of the split backward, against the remat stash (the layer inputs).
ZB-H1 (Qi et al. 2024) delays rank r's W by r rounds, so rank r would hold r of them
beside its p - r stashes; the tool prints each rank's predicted peak against 1F1B's
(`framework/analysis/memory_model.py`, the GPU compiler's terms).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from framework.runtime.quiet import import_jax  # noqa: E402

import_jax()

from framework.units import GIB  # noqa: E402



def state_bytes(model, parallel, batch: int, seq: int) -> dict:
    """Bytes per device of one microbatch-chunk's residuals, saved inputs and douts."""
    import jax
    import jax.numpy as jnp

    from framework.analysis.executor_state import trace_per_device
    from framework.engine.resolved import resolved
    from framework.parallel.mesh import PIPE
    from framework.parallel.pipeline import ticks

    lay = resolved(model, parallel, seq, batch)
    found = {}

    def measure(fns, params, inputs, targets, docs):
        types = ticks.make_cells(lay.program, fns, params, inputs, targets,
                                 jax.lax.axis_index(PIPE)).types
        size = lambda xs: sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in xs)
        per_layer = sum((p.hi - p.lo) * size(p.like) for p in types.pieces)  # in place
        found.update(residuals=per_layer, saved=size(types.saved), douts=size(types.douts))
        return jnp.zeros(())

    trace_per_device(lay, measure)
    return found


def report(recipe: str) -> None:
    from framework.analysis.memory_model import predict_memory
    from framework.engine.validate import validate
    from tools.recipe import compose

    cfg = compose([f"recipe={recipe}"])
    model, train = cfg.model, cfg.train

    def layout(schedule, remat):
        par = dataclasses.replace(cfg.parallel, schedule=schedule, remat=remat,
                                  virtual_stages=1, stage_layers=None)
        return validate(model, par, train, par.n_devices)

    stash = state_bytes(model, layout("1f1b", "full"), train.global_batch_size,
                        train.seq_len)["residuals"]
    split = state_bytes(model, layout("zb_h1", "none"), train.global_batch_size, train.seq_len)
    kept = split["saved"] + split["douts"]
    base = predict_memory(model, layout("1f1b", "full"), train, "gpu")["total"]
    p = cfg.parallel.pipeline
    print(f"{recipe} (pipeline {p}): remat stash {stash / GIB:.3f} GiB per microbatch-chunk; "
          f"W's inputs {split['saved'] / GIB:.3f} + output gradients "
          f"{split['douts'] / GIB:.3f} GiB = {kept / stash:.1f}x it; 1F1B's peak "
          f"{base / GIB:.2f} GiB")
    for r in range(p):
        peak = base - r * stash + r * kept
        print(f"  rank {r}: {r} W's pending: {peak / GIB:.2f} GiB = {peak / base:.2f}x")


if __name__ == "__main__":
    for name in sys.argv[1:] or ["llama3_8b", "llama3_70b"]:
        report(name)
