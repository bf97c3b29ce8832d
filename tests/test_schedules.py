"""GPipe, circular and 1F1B: parity with the reference, bubble, memory and the plot."""

import dataclasses

import numpy as np
import pytest

from framework.engine import idle_stage_ticks, measured_bubble
from framework.pipeline.schedule import FWD, BWD, make_schedule, one_f_one_b
from tests.helpers import (MODEL, TRAIN, engine, max_rel_err, params, reference_grads,
                           reference_losses, tokens, worst, engine_losses)

CASES = [  # (schedule, pipeline, microbatches, virtual_stages, data, tensor)
    ("gpipe", 2, 4, 1, 1, 1), ("gpipe", 4, 8, 1, 1, 1),
    ("circular", 2, 2, 2, 1, 1), ("circular", 2, 4, 2, 1, 1),
    ("circular", 4, 4, 2, 1, 1), ("circular", 4, 8, 2, 1, 1), ("circular", 2, 4, 2, 2, 2),
    ("1f1b", 2, 2, 1, 1, 1), ("1f1b", 2, 4, 1, 1, 1), ("1f1b", 4, 4, 1, 1, 1),
    ("1f1b", 4, 8, 1, 1, 1), ("1f1b", 2, 4, 1, 2, 2), ("1f1b", 4, 4, 1, 2, 1),
]


@pytest.fixture(scope="module")
def ref():
    return reference_grads()


@pytest.mark.parametrize("sched,pp,mb,v,dp,tp", CASES, ids=lambda x: str(x))
def test_schedule_gradients_and_bubble(sched, pp, mb, v, dp, tp, ref):
    eng = engine(pp, dp, tp, mb, schedule=sched, virtual_stages=v)
    loss, grads, useful = eng.loss_and_grads_fn()(eng.shard_params(params()),
                                                  eng.shard_batch(tokens(0)))
    assert abs(float(loss) - float(ref[0])) <= 1e-5 * float(ref[0])
    assert worst(max_rel_err(eng.canonical_params(grads), ref[1])) <= 1e-4
    # Bubble: the executed loop's counters agree with the table and the closed form
    # (1F1B in unit ticks: (p-1)/(m+p-1), Megatron-LM's (p-1)/m of the ideal time).
    formula = (pp - 1) / (v * mb + pp - 1)
    assert measured_bubble(eng.schedule, np.asarray(useful)) == pytest.approx(formula)
    assert eng.schedule.bubble_fraction == pytest.approx(formula)


@pytest.mark.parametrize("sched", ["circular", "1f1b"])
def test_schedules_train_like_the_reference(sched):
    ref_losses, _ = reference_losses(3)
    kw = dict(virtual_stages=2) if sched == "circular" else {}
    losses, _ = engine_losses(engine(2, 2, 2, 4, schedule=sched, **kw), 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_1f1b_with_remat_keeps_parity(remat, ref):
    eng = engine(2, 1, 2, 4, schedule="1f1b", remat=remat)
    _, grads, _ = eng.loss_and_grads_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
    assert worst(max_rel_err(eng.canonical_params(grads), ref[1])) <= 1e-4


def test_1f1b_table_keeps_at_most_pipeline_microbatches_in_flight():
    for p, m in [(2, 8), (4, 16), (8, 16)]:
        s = one_f_one_b(p, m)
        assert list(s.max_in_flight()) == [p - i for i in range(p)]
        # every microbatch is forwarded then backwarded exactly once per stage
        assert ((s.action == FWD).sum(0) == m).all() and ((s.action == BWD).sum(0) == m).all()


def temp_bytes(sched, m):
    """Compiled temp memory at pipeline=4 with a fixed microbatch of 2 sequences."""
    train = dataclasses.replace(TRAIN, global_batch_size=2 * m, seq_len=32)
    eng = engine(4, 1, 1, m, train=train, schedule=sched)
    state = eng.init_state(params())
    return eng.compile(state, eng.shard_batch(tokens(0, train)))["memory/temp_bytes_per_device"]


def test_1f1b_memory_does_not_grow_with_microbatches():
    gpipe_4, gpipe_16 = temp_bytes("gpipe", 4), temp_bytes("gpipe", 16)
    f1b_4, f1b_16 = temp_bytes("1f1b", 4), temp_bytes("1f1b", 16)
    print(f"temp bytes gpipe m=4 {gpipe_4} m=16 {gpipe_16}; 1f1b m=4 {f1b_4} m=16 {f1b_16}")
    assert f1b_16 <= 1.25 * f1b_4
    assert gpipe_16 > 1.5 * gpipe_4
    assert f1b_16 < gpipe_16


@pytest.mark.parametrize("sched,v", [("gpipe", 1), ("circular", 2), ("1f1b", 1)])
def test_plot_draws_the_engines_table(sched, v, tmp_path):
    from tools.schedule_plot import draw
    model = dataclasses.replace(MODEL, n_layers=4)
    eng = engine(2, 1, 1, 4, model=model, schedule=sched, virtual_stages=v)
    _, _, useful = eng.loss_and_grads_fn()(eng.shard_params(params(model)),
                                           eng.shard_batch(tokens(0, TRAIN, model)))
    path = tmp_path / f"{sched}.png"
    idle = draw(make_schedule(sched, 2, 4, v), str(path))
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
    assert idle == idle_stage_ticks(eng.schedule, np.asarray(useful))
