"""The planner's gradient-accumulation traffic (framework/analysis/accumulation.py)
against the compiled program's own count: the bytes the kernels of the `accumulate`
scope read and write per step (`framework.compile`'s
`traffic/accumulated_bytes_per_step`), on this process's 8 CPU devices, whose compiler
keeps the tick executor's accumulators in place inside the cells' conditionals (as the
GPU compiler from jaxlib 0.11.2 does).

Two known differences make the band [0.9, 1.25] (measured 2026-12-03: 0.93 for 1F1B at
4 and 8 microbatches, 1.09 for ZB-V and interleaved 1F1B, 1.06 with bfloat16 parameters,
1.20 without a pipeline): XLA:CPU hands some weight gradients to their add in float32
where a GPU's bfloat16 dW matmul writes bfloat16 (12 bytes an element against the priced
10: the chunks of a [v, Lc, ...] accumulator, every gradient without a pipeline); and
the report's figure is the mean over the pipeline's ranks, where the planner prices the
head's rank (the head's accumulator on one rank of p: this tiny model's head is a sixth
of its accumulators). A wrong count of the adds (per tick instead of per microbatch, a
rank's chunks for a chunk's, the head's left out) falls outside."""

import pytest

from framework.analysis.accumulation import accumulated_bytes
from framework.compile import program, targets
from framework.engine.resolved import resolved
from framework.engine.validate import validate
from tests.helpers import compose_recipe

BF16 = ("model.dtype=bfloat16",)


def _both(*overrides: str) -> tuple[float, float]:
    """(the compiled program's accumulation bytes, the planner's) per device per step."""
    cfg = compose_recipe("llama_tiny_debug", "target=local", *BF16, *overrides,
                         "train.global_batch_size=32",
                         config="compile")
    compiled = program.compile_report(cfg, targets.parse("local"))
    par = validate(cfg.model, cfg.parallel, cfg.train, cfg.parallel.n_devices)
    lay = resolved(cfg.model, par, cfg.train.seq_len, cfg.train.global_batch_size)
    return (compiled["traffic/accumulated_bytes_per_step"],
            accumulated_bytes(lay, cfg.optim.param_dtype, "cpu"))


@pytest.mark.parametrize("overrides", [
    ("parallel.schedule=1f1b", "parallel.microbatches=4"),
    pytest.param(("parallel.schedule=1f1b", "parallel.microbatches=8"), marks=pytest.mark.slow),
    pytest.param(("parallel.schedule=zb_v", "parallel.microbatches=4"), marks=pytest.mark.slow),
    pytest.param(("parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2",
                  "parallel.microbatches=4"), marks=pytest.mark.slow),
    pytest.param(("parallel.schedule=1f1b", "parallel.microbatches=4",
                  "optim.param_dtype=bfloat16"), marks=pytest.mark.slow),
    pytest.param(("parallel.pipeline=1", "parallel.data=4", "parallel.microbatches=2"),
                 marks=pytest.mark.slow),
], ids=lambda o: " ".join(o))
def test_the_priced_accumulation_is_what_the_compiled_adds_touch(overrides):
    compiled, priced = _both(*overrides)
    assert priced > 0 and 0.9 <= compiled / priced <= 1.25, (compiled, priced)


def test_one_microbatch_without_a_pipeline_accumulates_nothing():
    compiled, priced = _both("parallel.pipeline=1", "parallel.data=4", "parallel.microbatches=1")
    assert compiled == priced == 0
