"""Combined 1F1B (`parallel.combined_1f1b`): a BW and the F after it on the same rank run
as one cell, their layer loops as one (framework/parallel/pipeline/ticks.py
`_combined_step`, stash.py `scan_fused`). The loss and every gradient equal the single
device's on the dense model and with experts split, through both lowerings of the tick
executor (in place; apart, as the GPU compiler before jaxlib 0.11.2 needs it), with
ZeRO-1, FSDP, sequence and context parallelism, remat, uneven stages and a capacity
factor; the buffer plan keeps a BW's slot from the F beside it; bad combinations are
refused in one line.
"""

import pytest

from framework.errors import ConfigError
from framework.parallel.pipeline import buffers
from framework.parallel.pipeline.program import program
from framework.parallel.pipeline.schedule import make_schedule
from tests.helpers import (canonical_of, engine, max_rel_err, params, reference_grads, tokens,
                           worst)
from tests.parity.test_expert_parallel import model_of
from tests.parity.test_moe import check as check_moe

COMBINED = dict(combined_1f1b=True, overlap_sends=True)


@pytest.fixture(scope="module")
def ref():
    return reference_grads()


def check(ref, pp, dp, tp, mb, **kw):
    eng = engine(pp, dp, tp, mb, **COMBINED, **kw)
    loss, grads = eng.loss_and_grads_fn()(eng.shard_params(params()), eng.shard_batch(tokens(0)))
    assert abs(float(loss) - float(ref[0])) <= 1e-5 * float(ref[0])
    assert worst(max_rel_err(canonical_of(eng, grads), ref[1])) <= 1e-4


def test_combined_1f1b_on_pp2_dp2_tp2_equals_one_device(ref):
    check(ref, 2, 2, 2, 4, schedule="1f1b")


# (until 2026-12-01 also four stages with remat and interleaved with context 2: the
# parity search draws the combined cells on every layout they run on)
DENSE = {
    "interleaved_zero1_sp": (2, 2, 2, 4, dict(schedule="interleaved_1f1b", virtual_stages=2,
                                              zero1=True, sequence_parallel=True)),
    "uneven_fsdp": (2, 2, 1, 4, dict(schedule="1f1b", stage_layers=[3, 5], fsdp=True)),
    "pp1": (1, 2, 2, 4, dict(schedule="1f1b")),  # no sends: F(i+1) beside BW(i) alone
}


@pytest.mark.slow
@pytest.mark.parametrize("name", DENSE)
def test_combined_1f1b_on_every_path_equals_one_device(name, ref):
    pp, dp, tp, mb, kw = DENSE[name]
    check(ref, pp, dp, tp, mb, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_combined_1f1b_apart_as_on_older_gpus_equals_one_device(name, v, ref, monkeypatch):
    """The lowering of the GPU compiler before jaxlib 0.11.2 (`Cells.apart`: F's slot
    and BW's gradients written after the combined cell's conditional), forced on CPU."""
    from framework.engine import step

    monkeypatch.setattr(step, "passes_through", lambda platform: False)
    check(ref, 4 // v, 1, 1, 8, schedule=name, virtual_stages=v)


MOE = {  # (interleaved with FSDP and experts split: tests/parity/test_dense_prefix.py)
    "capacity_chunks_sp_zero1": ("qwen3_moe@0.75", dict(schedule="1f1b", expert_chunks=2,
                                                        sequence_parallel=True, zero1=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE)
def test_combined_1f1b_with_experts_split_equals_one_device(name):
    family, kw = MOE[name]
    check_moe(model_of(family), dict(pipeline=2, data=2, tensor=2, microbatches=4, expert=2,
                                     **COMBINED, **kw))


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2)])
def test_the_buffer_plan_keeps_a_bw_slot_from_the_f_beside_it(name, p, m, v):
    """Run combined, 1F1B's plan (an F takes the slot its tick's BW frees) would have
    the F write rows the BW beside it still reads: the replay says so; the combined
    plan holds one slot more a rank and replays cleanly."""
    s = make_schedule(name, p, m, v, True)
    plain = buffers._plan(s)
    with pytest.raises(ValueError, match="overwrites stash slot"):
        buffers.check(s, plain, combined=True)
    both = buffers.plan(s, combined=True)
    assert both.n_slots["stash"] == plain.n_slots["stash"] + 1
    assert program(name, p, m, v, True, combined=True).fused.any()


@pytest.mark.parametrize("kw,named", [
    (dict(schedule="zb_h1"), "zb_h1"),
    (dict(schedule="1f1b", overlap_sends=False), "synchronous sends"),
    (dict(schedule="gpipe"), "gpipe"),
])
def test_combined_1f1b_refused_where_it_cannot_run(kw, named):
    with pytest.raises(ConfigError, match=f"parallel.combined_1f1b.*{named}"):
        engine(2, 1, 1, 4, combined_1f1b=True, **kw)
