"""Pipeline schedules: parity with the reference, the tables and their buffer plans,
memory, and the plot."""

import dataclasses

import numpy as np
import pytest

from framework.parallel.pipeline import buffers as buffers_lib
from framework.analysis import audit
from framework.parallel.pipeline import schedule as schedules
from framework.parallel.pipeline.schedule import BW, B, F, W, make_schedule
from tests.helpers import (MODEL, TRAIN, engine, engine_losses, max_rel_err, params,
                           reference_grads, reference_losses, tokens, worst)

CASES = [  # (schedule, pipeline, microbatches, virtual_stages, data, tensor, extra settings)
    # (GPipe's layouts are in tests/test_parity.py)
    ("circular", 4, 8, 2, 1, 1, {}), ("circular", 2, 4, 2, 2, 2, {}),
    ("1f1b", 4, 8, 1, 1, 1, {}), ("1f1b", 2, 4, 1, 2, 2, {}),
    ("interleaved_1f1b", 4, 8, 2, 1, 2, {}), ("interleaved_1f1b", 4, 4, 1, 2, 1, {}),
    ("interleaved_1f1b", 2, 4, 2, 2, 2, dict(zero1=True)),
    ("zb_h1", 4, 8, 1, 1, 1, {}), ("zb_h1", 2, 4, 1, 2, 2, dict(sequence_parallel=True)),
    ("zb_h1", 4, 4, 1, 1, 2, dict(zero1=False, remat="full")),
]


@pytest.fixture(scope="module")
def ref():
    return reference_grads()


@pytest.mark.parametrize("sched,pp,mb,v,dp,tp,kw", CASES, ids=lambda x: str(x))
def test_schedule_loss_and_gradients_match_reference(sched, pp, mb, v, dp, tp, kw, ref):
    eng = engine(pp, dp, tp, mb, schedule=sched, virtual_stages=v, **kw)
    loss, grads = eng.loss_and_grads_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
    assert abs(float(loss) - float(ref[0])) <= 1e-5 * float(ref[0])
    assert worst(max_rel_err(eng.canonical_params(grads), ref[1])) <= 1e-4


@pytest.mark.parametrize("sched,v,kw", [
    ("circular", 2, {}), ("1f1b", 1, {}),
    ("interleaved_1f1b", 2, dict(zero1=True)), ("zb_h1", 1, dict(sequence_parallel=True))],
    ids=["circular", "1f1b", "interleaved_1f1b+zero1", "zb_h1+sp"])
def test_schedules_train_like_the_reference(sched, v, kw):
    ref_losses, _ = reference_losses(5)
    losses, _ = engine_losses(engine(2, 2, 2, 4, schedule=sched, virtual_stages=v, **kw), 5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


# --- Tables --------------------------------------------------------------------------

def test_every_registered_table_passes_its_check():
    for name in schedules.schedule_names():
        for p, m in [(1, 1), (1, 3), (2, 2), (2, 4), (4, 4), (4, 8), (3, 6)]:
            for v in (1, 2) if schedules.uses_virtual_stages(name) else (1,):
                if schedules.check(name, p, m, v):
                    continue
                s = make_schedule(name, p, m, v)
                buffers_lib.plan(s)  # raises if a slot is overwritten while live
                kinds = (F, BW) if not s.split_backward else (F, B, W)
                for k in kinds:  # each microbatch passes each stage once per kind
                    assert ((s.kind == k).sum(axis=0) == m * v).all(), (name, p, m, v, k)


def test_zero_bubble_and_interleaving_shrink_the_bubble_as_the_papers_predict():
    for p, m in [(2, 4), (4, 8), (4, 16), (8, 16)]:
        f1b, zb = make_schedule("1f1b", p, m), make_schedule("zb_h1", p, m)
        # Qi et al. 2024, unit costs: 1F1B idles (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W).
        assert zb.bubble_fraction < f1b.bubble_fraction
        assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
        assert zb.n_ticks == 3 * m + p - 1
        bubbles = [make_schedule("interleaved_1f1b", p, m, v).bubble_fraction for v in (1, 2, 4)]
        assert bubbles[0] > bubbles[1] > bubbles[2]
        # In ticks, Megatron-LM's (p-1)/(v m) of the ideal time (Narayanan et al. 2021).
        for v in (1, 2, 4):
            s = make_schedule("interleaved_1f1b", p, m, v)
            assert s.n_ticks == 2 * v * m + 2 * (p - 1)
    # Interleaved with one chunk is 1F1B, cell for cell.
    a, b = make_schedule("interleaved_1f1b", 4, 8, 1), make_schedule("1f1b", 4, 8)
    assert (a.kind == b.kind).all() and (a.microbatch == b.microbatch).all()


def test_memory_in_flight_is_bounded_like_1f1b():
    for p, m in [(2, 8), (4, 16), (8, 16)]:
        assert list(make_schedule("1f1b", p, m).max_in_flight()) == [p - r for r in range(p)]
        assert list(make_schedule("zb_h1", p, m).max_in_flight()) == [p] * p  # ZB-H1: p each
        # p*v chunk activations = p stages' worth, as 1F1B's first rank.
        assert make_schedule("interleaved_1f1b", p, m, 2).max_in_flight().max() == 2 * p
        plan = buffers_lib.plan(make_schedule("zb_h1", p, m))
        assert plan.n_slots["stash"] == p


def test_buffer_check_catches_an_overwritten_slot():
    s = make_schedule("1f1b", 4, 8)
    plan = buffers_lib.plan(s)
    bad_stash = np.where(plan.stash >= 0, 0, -1)  # every microbatch in slot 0
    with pytest.raises(ValueError, match="overwrites stash slot"):
        buffers_lib.check(s, dataclasses.replace(plan, stash=bad_stash))
    early = s.kind.copy()  # a forward moved before the one it depends on
    t, r = np.argwhere((s.kind == F) & (np.arange(4)[None, :] == 1))[0]
    early[0, 1], early[t, r] = F, 0
    moved = dataclasses.replace(s, kind=early, microbatch=s.microbatch.copy())
    moved.microbatch[0, 1] = s.microbatch[t, r]
    with pytest.raises(ValueError, match="runs before"):
        buffers_lib.check(moved, plan)


def test_invalid_combinations_are_one_line_errors():
    from framework.errors import ConfigError
    from framework.config import ParallelConfig
    from framework.engine.validate import validate
    cases = [(dict(schedule="interleaved_1f1b", microbatches=6, virtual_stages=2), "multiple of parallel.pipeline"),
             (dict(schedule="zb_h1", virtual_stages=2), "parallel.virtual_stages=2 only applies"),
             (dict(schedule="circular", microbatches=2, virtual_stages=2), "microbatches >= pipeline"),
             (dict(schedule="zigzag"), "parallel.schedule='zigzag' is not one of")]
    for kw, text in cases:
        with pytest.raises(ConfigError) as err:
            validate(MODEL, ParallelConfig(pipeline=4, data=2, **{"microbatches": 8, **kw}), TRAIN, 8)
        assert text in str(err.value) and "\n" not in str(err.value), str(err.value)


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


# --- Memory --------------------------------------------------------------------------

def temp_bytes(sched, m, v=1):
    """Compiled temp memory at pipeline=4 with a fixed microbatch of 2 sequences."""
    train = dataclasses.replace(TRAIN, global_batch_size=2 * m, seq_len=32)
    eng = engine(4, 1, 1, m, train=train, schedule=sched, virtual_stages=v)
    state, toks = eng.abstract_inputs(train.global_batch_size, train.seq_len)
    return audit.step_stats(eng, state, toks)["memory/temp_bytes_per_device"]


def test_tick_schedules_memory_does_not_grow_with_microbatches():
    got = {(s, m): temp_bytes(s, m, 2 if s == "interleaved_1f1b" else 1)
           for s in ("interleaved_1f1b", "zb_h1") for m in (4, 16)}
    got.update({(s, 16): temp_bytes(s, 16) for s in ("gpipe", "1f1b")})
    print("temp bytes (pipeline 4):", got)
    for s in ("interleaved_1f1b", "zb_h1"):
        assert got[s, 16] <= 1.25 * got[s, 4], s  # bounded like 1F1B's
    for s in ("1f1b", "interleaved_1f1b", "zb_h1"):
        assert got[s, 16] < got["gpipe", 16], s  # GPipe keeps all 16 microbatches
    assert got["zb_h1", 16] <= 1.1 * got["1f1b", 16]  # ZB-H1: 1F1B's activation memory


@pytest.mark.parametrize("sched,v", [("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)])
def test_plot_draws_the_table(sched, v, tmp_path):
    from tools.schedule_plot import draw
    s = make_schedule(sched, 2, 4, v)
    path = tmp_path / f"{sched}.png"
    idle = draw(s, str(path))
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
    assert idle == int((s.kind == 0).sum())
