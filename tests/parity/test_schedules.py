"""Every registered pipeline schedule against the single-device reference: the loss and
every gradient after one step, at several layouts, and five AdamW steps. The cases are
made from the registry (`framework/parallel/pipeline/schedule.py`), so a newly
registered schedule is tested without editing this file.

    pytest tests/parity -k zb_h1            # one schedule, every layout
    pytest tests/parity -k "pp4-mb8"        # one layout, every schedule
"""

import numpy as np
import pytest

from framework.parallel.pipeline import schedule as schedules
from framework.parallel.pipeline.schedule import BW, F
from tests.helpers import (engine, engine_losses, max_rel_err, params, reference_grads,
                           reference_losses, tokens, worst)

# (pipeline, microbatches, data, tensor, extra settings): every schedule runs each one
# whose degrees its rules accept; the extras combine the schedule once with ZeRO-1,
# sequence parallelism and full rematerialisation.
LAYOUTS = [
    (4, 8, 1, 1, {}),
    (2, 4, 2, 2, {"zero1": True}),
    (4, 4, 1, 2, {"sequence_parallel": True, "remat": "full"}),
]
EXTRA_NAMES = {"zero1": "zero1", "sequence_parallel": "sp", "remat": "remat"}


def _case_id(name, p, m, d, t, v, kw) -> str:
    extra = "".join(f"-{EXTRA_NAMES[k]}" for k in kw)
    return f"{name}-pp{p}-mb{m}-dp{d}-tp{t}" + (f"-v{v}" if v > 1 else "") + extra


def cases():
    out = []
    for name in schedules.schedule_names():
        v = 2 if schedules.uses_virtual_stages(name) else 1
        for i, (p, m, d, t, kw) in enumerate(LAYOUTS):
            if not schedules.check(name, p, m, v):  # the first layout: the fast tier
                out.append(pytest.param(name, p, m, d, t, v, kw,
                                        id=_case_id(name, p, m, d, t, v, kw),
                                        marks=[pytest.mark.slow] if i else []))
    return out


@pytest.fixture(scope="module")
def ref():
    return reference_grads()


@pytest.mark.parametrize("name,pp,mb,dp,tp,v,kw", cases())
def test_loss_and_every_gradient_match_the_reference(name, pp, mb, dp, tp, v, kw, ref):
    eng = engine(pp, dp, tp, mb, schedule=name, virtual_stages=v, **kw)
    loss, grads = eng.loss_and_grads_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
    assert abs(float(loss) - float(ref[0])) <= 1e-5 * float(ref[0])
    assert worst(max_rel_err(eng.canonical_params(grads), ref[1])) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", schedules.schedule_names())
def test_five_adamw_steps_with_zero1_and_sp_train_like_the_reference(name):
    v = 2 if schedules.uses_virtual_stages(name) else 1
    ref_losses, _ = reference_losses(5)
    eng = engine(2, 2, 2, 4, schedule=name, virtual_stages=v, zero1=True,
                 sequence_parallel=True)
    losses, _ = engine_losses(eng, 5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_a_new_schedule_is_one_registered_generator(ref):
    """GPipe's order run by the tick executor (backward included) instead of autodiff:
    registered here, nowhere else, and it trains like the reference."""
    @schedules.register("test_gpipe_ticks")
    def gpipe_ticks(p, m, v):
        programs = [[(F, i, 0) for i in range(m)] + [(BW, i, 0) for i in range(m)] for _ in range(p)]
        return schedules.simulate("test_gpipe_ticks", p, m, 1, programs, (p - 1) / (m + p - 1))
    try:
        eng = engine(2, 2, 2, 4, schedule="test_gpipe_ticks")
        assert eng.schedule.executor == "ticks"
        loss, grads = eng.loss_and_grads_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
        assert worst(max_rel_err(eng.canonical_params(grads), ref[1])) <= 1e-4
    finally:
        del schedules.GENERATORS["test_gpipe_ticks"]
