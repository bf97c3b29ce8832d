"""Every (pipeline, data, tensor) layout computes what one device computes."""

import numpy as np
import pytest

from framework.parallel.pipeline import schedule as schedules

from tests.helpers import (engine, engine_grads, engine_losses, max_rel_err, params, reference_grads,
                           reference_losses, tokens, worst)

LAYOUTS = [  # (pipeline, data, tensor, microbatches)
    (1, 1, 1, 1), (2, 1, 1, 2), (4, 1, 1, 4), (1, 2, 1, 1), (1, 8, 1, 2), (1, 1, 2, 1),
    (1, 1, 4, 1), (2, 2, 2, 4), (2, 1, 4, 2), (4, 2, 1, 4), (1, 2, 4, 2),
]
FAST = {(1, 1, 1, 1), (1, 1, 4, 1), (2, 2, 2, 4), (1, 2, 4, 2)}  # fast tier
ONE_STEP = [layout if layout in FAST else pytest.param(*layout, marks=pytest.mark.slow)
            for layout in LAYOUTS]
# five optimizer steps on each axis alone and on the three mixed (until 2026-12-01 on all
# eleven: the others' one step above is exact, the optimizer's state is per leaf)
ADAMW = [(1, 1, 1, 1), (4, 1, 1, 4), (1, 8, 1, 2), (1, 1, 4, 1), (2, 2, 2, 4), (2, 1, 4, 2),
         (4, 2, 1, 4)]


@pytest.fixture(scope="module")
def ref_grads():
    return reference_grads()


@pytest.fixture(scope="module")
def ref_losses():
    return reference_losses(5)[0]


@pytest.mark.parametrize("pp,dp,tp,mb", ONE_STEP, ids=lambda v: str(v))
def test_one_step_loss_and_gradients_match_reference(pp, dp, tp, mb, ref_grads):
    ref_loss, ref_g = ref_grads
    loss, grads = engine_grads(engine(pp, dp, tp, mb))
    assert abs(loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    errs = max_rel_err(grads, ref_g)
    assert worst(errs) <= 1e-4, errs


@pytest.mark.slow
@pytest.mark.parametrize("pp,dp,tp,mb", ADAMW, ids=lambda v: str(v))
def test_five_adamw_steps_match_reference(pp, dp, tp, mb, ref_losses):
    losses, _ = engine_losses(engine(pp, dp, tp, mb), 5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]  # it trains


@pytest.mark.parametrize("mb", [pytest.param(1, marks=pytest.mark.slow),
                                pytest.param(2, marks=pytest.mark.slow), 4,
                                pytest.param(8, marks=pytest.mark.slow)])
def test_microbatch_count_does_not_change_gradients(mb, ref_grads):
    _, grads = engine_grads(engine(2, 1, 1, mb))
    assert worst(max_rel_err(grads, ref_grads[1])) <= 1e-4


@pytest.mark.slow
def test_tied_embeddings_and_bfloat16_compute():
    import dataclasses
    from tests.helpers import MODEL
    model = dataclasses.replace(MODEL, tie_embeddings=True)
    ref_loss, ref_g = reference_grads(model)
    loss, grads = engine_grads(engine(2, 2, 2, 2, model=model))
    assert worst(max_rel_err(grads, ref_g)) <= 1e-4
    bf16 = dataclasses.replace(MODEL, dtype="bfloat16")
    ref_loss, ref_g = reference_grads(bf16)
    loss, grads = engine_grads(engine(2, 2, 2, 2, model=bf16))
    assert abs(loss - float(ref_loss)) < 2e-2 * float(ref_loss)
    assert worst(max_rel_err(grads, ref_g)) < 0.1  # bf16 rounding, not a layout bug


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_keeps_parity(remat, ref_grads):
    _, grads = engine_grads(engine(2, 2, 2, 2, remat=remat))
    assert worst(max_rel_err(grads, ref_grads[1])) <= 1e-4


@pytest.mark.parametrize("kw", [dict(schedule="1f1b"), dict(zero1=True, sequence_parallel=True)],
                         ids=["1f1b", "zero1+sp"])
def test_eval_loss_is_the_forward_loss(kw, ref_grads):
    eng = engine(2, 2, 2, 4, **kw)
    loss = eng.eval_loss_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
    assert abs(float(loss) - float(ref_grads[0])) <= 1e-5 * float(ref_grads[0])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", schedules.schedule_names())
def test_eval_loss_is_the_forward_loss_under_every_schedule(schedule, ref_grads):
    """Evaluation runs a forward table over the training schedule's own stage map (a V
    for zb_v: its last stage is on rank 0, where the loss is taken)."""
    v = 2 if schedules.uses_virtual_stages(schedule) else 1
    eng = engine(2, 1, 1, 4, schedule=schedule, virtual_stages=v)
    loss = eng.eval_loss_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
    assert abs(float(loss) - float(ref_grads[0])) <= 1e-5 * float(ref_grads[0])
