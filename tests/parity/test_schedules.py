"""Every registered pipeline schedule against the single-device reference: the loss and
every gradient after one step, at several layouts, and five AdamW steps. The cases are
made from the registry (`framework/parallel/pipeline/schedule.py`), so a newly
registered schedule is tested without editing this file.

    pytest tests/parity -k zb_h1            # one schedule, every layout
    pytest tests/parity -k "pp4-mb8"        # one layout, every schedule
"""

import dataclasses

import numpy as np
import pytest

from framework.parallel.pipeline import schedule as schedules
from framework.parallel.pipeline.kinds import BW, F
from tests.helpers import (canonical_of, MODEL, engine, engine_losses, max_rel_err, params,
                           reference_grads, reference_losses, tokens, worst)

# (pipeline, microbatches, data, tensor, extra settings): every schedule runs each one
# whose degrees its rules accept; the extras combine the schedule once with ZeRO-1,
# sequence parallelism and full rematerialisation.
LAYOUTS = [
    (4, 8, 1, 1, {}),
    (2, 4, 2, 2, {"zero1": True, "overlap_sends": True}),
    (4, 4, 1, 2, {"sequence_parallel": True, "remat": "full", "overlap_sends": False}),
]
EXTRA_NAMES = {"zero1": "zero1", "sequence_parallel": "sp", "remat": "remat"}


def _case_id(name, p, m, d, t, v, kw) -> str:
    extra = "".join(f"-{EXTRA_NAMES[k]}" if k in EXTRA_NAMES else
                    f"-{'overlapped' if val else 'sync'}" for k, val in kw.items())
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
    assert worst(max_rel_err(canonical_of(eng, grads), ref[1])) <= 1e-4


# (The tick executor's three kinds of program: a fused backward, a split one, the V;
# until 2026-12-01 every schedule, 64 s of the suite. GPipe's autodiff and 1F1B train
# five AdamW steps in test_layouts.py; the parity search draws ZeRO-1 and SP on each.)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["interleaved_1f1b", "zb_h1", "zb_v"])
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
    def gpipe_ticks(p, m, v, overlap):
        programs = [[(F, i, 0) for i in range(m)] + [(BW, i, 0) for i in range(m)] for _ in range(p)]
        return schedules.simulate("test_gpipe_ticks", m, programs, (p - 1) / (m + p - 1),
                                  schedules.Clock.of(p, overlap=overlap))
    try:
        eng = engine(2, 2, 2, 4, schedule="test_gpipe_ticks")
        assert eng.schedule.executor == "ticks"
        loss, grads = eng.loss_and_grads_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
        assert worst(max_rel_err(canonical_of(eng, grads), ref[1])) <= 1e-4
    finally:
        del schedules.GENERATORS["test_gpipe_ticks"]


SLOW = pytest.mark.slow


@pytest.mark.parametrize("name,pp,tp,v,kw,parts", [
    ("1f1b", 2, 2, 1, {"remat": "full"}, 3),  # 4 layers a stage: BW in 3 parts
    pytest.param("1f1b", 2, 1, 1, {"sequence_parallel": True}, 2, marks=SLOW),
    pytest.param("interleaved_1f1b", 2, 2, 2, {"zero1": True}, 2, marks=SLOW),
    pytest.param("1f1b", 4, 1, 1, {"stage_layers": (3, 1, 2, 2)}, 2, marks=SLOW),
])  # (the last: a part of the 1-layer stage is padding)
def test_backward_in_parts_with_synchronous_sends(name, pp, tp, v, kw, parts, ref):
    """1F1B with synchronous sends cuts each BW into parts by layers (`table.py`),
    every part's VJP stashed by F and run as its own cell."""
    eng = engine(pp, 1, tp, 4, schedule=name, virtual_stages=v, overlap_sends=False, **kw)
    assert eng.schedule.parts == parts
    loss, grads = eng.loss_and_grads_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
    assert abs(float(loss) - float(ref[0])) <= 1e-5 * float(ref[0])
    assert worst(max_rel_err(canonical_of(eng, grads), ref[1])) <= 1e-4


# Uneven stages (`parallel.stage_layers`): the split backward with and without remat
# (ZB-H1; ZB-V's V), and the autodiff executor on four stages, combined with data,
# tensor, sequence parallelism and ZeRO-1 (the parity search draws more).
UNEVEN = [
    ("zb_h1", 2, 4, 2, 2, 1, (3, 5), {"zero1": True, "sequence_parallel": True}),
    ("zb_v", 2, 4, 2, 2, 1, (1, 2, 3, 2), {"zero1": True, "sequence_parallel": True,
                                           "remat": "full"}),
    ("gpipe", 4, 4, 1, 2, 1, (1, 3, 3, 1), {"sequence_parallel": True}),
]


@pytest.mark.parametrize("name,pp,mb,dp,tp,v,counts,kw", [
    pytest.param(*case, id=f"{case[0]}-{'-'.join(map(str, case[6]))}",
                 marks=pytest.mark.slow) for case in UNEVEN])
def test_uneven_stages_match_the_reference(name, pp, mb, dp, tp, v, counts, kw, ref):
    eng = engine(pp, dp, tp, mb, schedule=name, virtual_stages=v, stage_layers=counts, **kw)
    assert eng.layout.stage_layers == counts
    loss, grads = eng.loss_and_grads_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
    assert abs(float(loss) - float(ref[0])) <= 1e-5 * float(ref[0])
    assert worst(max_rel_err(canonical_of(eng, grads), ref[1])) <= 1e-4


@pytest.mark.slow
def test_thirty_layers_train_on_four_stages_like_the_reference():
    """A layer count the pipeline does not divide, `auto`: three AdamW steps (the
    padding's zero gradients and weight decay leave it zero) like one device."""
    model = dataclasses.replace(MODEL, n_layers=30, d_model=32, n_heads=4, n_kv_heads=2,
                                d_ff=64)
    ref_losses, ref_params = reference_losses(3, model)
    eng = engine(4, 2, 1, 4, model=model, schedule="1f1b", stage_layers="auto")
    assert eng.layout.stage_layers == (8, 8, 7, 7)
    losses, got = engine_losses(eng, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert worst(max_rel_err(got, ref_params)) <= 1e-4


# (Each kind of program once, sends overlapped or not in turn; until 2026-12-01 each
# both ways, 49 s of the suite: the parity search draws the dispatch with either.)
@pytest.mark.slow
@pytest.mark.parametrize("name,v,remat,overlap", [
    ("1f1b", 1, "none", True), ("interleaved_1f1b", 2, "none", False),
    ("zb_h1", 1, "none", True), ("zb_v", 1, "none", False), ("zb_h1", 1, "full", False)])
def test_the_accelerator_dispatch_matches_the_reference(name, v, remat, overlap, ref,
                                                        monkeypatch):
    """The tick executor as it runs on GPUs before jaxlib 0.11.2 (`Cells.apart`: the
    weight gradients leave their cell's conditional and are added after it), forced on
    CPU (as the randomized search's `gpu_dispatch` forces it)."""
    from framework.engine import step

    monkeypatch.setattr(step, "passes_through", lambda platform: False)
    eng = engine(4, 1, 1, 8, schedule=name, virtual_stages=v, overlap_sends=overlap,
                 remat=remat)
    loss, grads = eng.loss_and_grads_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
    assert abs(float(loss) - float(ref[0])) <= 1e-5 * float(ref[0])
    assert worst(max_rel_err(canonical_of(eng, grads), ref[1])) <= 1e-4


@pytest.mark.parametrize("name,overlap", [("1f1b", True), ("zb_h1", False)])
def test_the_accelerator_dispatch_with_the_embedding_over_tensor_matches_the_reference(
        name, overlap, ref, monkeypatch):
    """As above, with the vocabulary-parallel embedding and sequence parallelism: the
    embedding's gradient in two halves (`StageFns.embed_rows`), the rows' gradient in the
    first stage's conditional (an all-gather over `tensor`), their scatter-add into the
    table after it on every rank."""
    from framework.engine import step

    monkeypatch.setattr(step, "passes_through", lambda platform: False)
    eng = engine(2, 2, 2, 4, schedule=name, overlap_sends=overlap, sequence_parallel=True)
    loss, grads = eng.loss_and_grads_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
    assert abs(float(loss) - float(ref[0])) <= 1e-5 * float(ref[0])
    assert worst(max_rel_err(canonical_of(eng, grads), ref[1])) <= 1e-4
