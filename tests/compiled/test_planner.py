"""The planner (framework/analysis/planner.py): the layouts it enumerates, how its memory
terms follow the settings, how it marks and ranks layouts, and its command line. Its
predictions against the compiled programs: tests/compiled/test_memory.py."""

import dataclasses

import pytest

from framework.analysis import comm_model, memory_model, planner
from framework.compile import targets
from framework.config import ModelConfig, ParallelConfig, TrainConfig
from framework.engine.validate import validate

# Big enough that activations, weights and optimizer state all weigh (~300 MiB at one
# device, a third of it not activations), small enough to compile in a few seconds.
MODEL = ModelConfig(vocab_size=512, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                    d_ff=512, dtype="float32")
TRAIN = TrainConfig(seq_len=64, global_batch_size=16)


def test_memory_terms_follow_the_schedule_zero1_and_remat():
    mem = lambda **kw: memory_model.predict_memory(MODEL, ParallelConfig(**kw), TRAIN)
    gpipe = mem(pipeline=2, microbatches=8)
    f1b, sync = (mem(pipeline=2, microbatches=8, schedule="1f1b", overlap_sends=o)
                 for o in (True, False))
    # GPipe keeps all m + p - 1 ticks, 1F1B at most p microbatches (doubled, see module),
    # 2p - 1 with overlapped sends (whose backward tick writes no slot of zeros: at p 2
    # the two about even out, at p 4 seven microbatches against four)
    assert sync["activations"] < gpipe["activations"] / 2
    assert f1b["activations"] < gpipe["activations"] / 2
    f1b, sync = (mem(pipeline=4, microbatches=8, schedule="1f1b", overlap_sends=o)
                 for o in (True, False))
    assert sync["activations"] < f1b["activations"]
    plain, zero1 = mem(data=4), mem(data=4, zero1=True)
    assert zero1["params"] + zero1["optimizer"] == pytest.approx(
        (plain["params"] + plain["optimizer"]) / 4, rel=0.02)
    assert mem(remat="full")["activations"] < mem()["activations"] / 5


def test_enumeration_is_valid_and_covers_the_layouts():
    found = planner.enumerate_layouts(MODEL, TRAIN, 8, ParallelConfig())
    key = lambda p: (p.pipeline, p.data, p.tensor, p.microbatches, p.schedule,
                     p.virtual_stages, p.zero1, p.fsdp)
    keys = [key(p) for p in found]
    assert len(keys) == len(set(keys))
    for par in found:  # every one passes the same validation a run does
        assert validate(MODEL, par, TRAIN, 8).n_devices == 8
        assert par.microbatches >= par.pipeline
    for expected in [(1, 8, 1, 1, "gpipe", 1, True, False), (2, 2, 2, 4, "gpipe", 1, False, False),
                     (2, 2, 2, 8, "1f1b", 1, True, False), (2, 4, 1, 2, "circular", 2, False, False),
                     (1, 2, 4, 1, "gpipe", 1, False, False), (8, 1, 1, 16, "1f1b", 1, False, False),
                     (2, 4, 1, 4, "interleaved_1f1b", 2, False, False),
                     (4, 2, 1, 4, "zb_h1", 1, True, False), (2, 2, 2, 4, "zb_v", 1, False, True),
                     (1, 2, 4, 8, "gpipe", 1, True, False),  # gradient accumulation
                     (1, 4, 2, 2, "gpipe", 1, False, True)]:
        assert expected in keys, expected
    assert not any(k[7] and k[1] == 1 for k in keys)  # FSDP needs more than one replica
    assert not any(k[2] == 8 for k in keys)  # n_kv_heads = 4 cannot be split 8 ways
    assert not any(k[0] == 8 and k[4] == "circular" for k in keys)  # 8 layers, 16 chunks


@pytest.mark.slow
def test_fit_marking_and_ranking():
    # (4 devices: until 2026-12-01 8, whose layouts' tick-executor states took 102 traces
    # and 50 s of the suite for the same ordering)
    sizes = sorted(memory_model.predict_memory(MODEL, p, TRAIN)["total"]
                   for p in planner.enumerate_layouts(MODEL, TRAIN, 4, ParallelConfig()))
    limit = sizes[len(sizes) // 2]  # about half the layouts fit
    hw = planner.Hardware(memory_bytes=limit, peak_flops=1e12, memory_fraction=1.0)
    plans = planner.plan(MODEL, TRAIN, ParallelConfig(), 4, hw)
    assert {pl.fits for pl in plans} == {True, False}
    for pl in plans:
        assert pl.fits == (pl.memory["total"] <= limit)
    fits = [pl.fits for pl in plans]
    assert fits == sorted(fits, reverse=True)  # every fitting layout before the others
    times = [pl.time["total"] for pl in plans if pl.fits]
    assert times == sorted(times)
    text = planner.table(plans, top=3, unfit=2)
    assert text.count(" yes ") >= 3 and text.count(" NO ") == 2


def test_time_model_bubble_and_bandwidth():
    hw = planner.Hardware(memory_bytes=1e12, peak_flops=1e12)
    t = lambda hw=hw, **kw: planner.predict_time(MODEL, ParallelConfig(**kw), TRAIN, hw)
    assert t(pipeline=4, microbatches=16)["compute"] < t(pipeline=4, microbatches=4)["compute"]
    assert t(pipeline=4, microbatches=4)["bubble"] == pytest.approx(3 / 7)
    # Lockstep ticks: ZB-H1 idles least; 1F1B as GPipe (the closed form) with overlapped
    # sends (paired ticks) and with synchronous ones (BWs in parts, framework/parallel/
    # pipeline/table.py); the whole-BW synchronous table idled 40.0% against 27.3%.
    zb, f1b, gp, sync = (t(pipeline=4, microbatches=8, schedule=s, overlap_sends=o)["compute"]
                         for s, o in (("zb_h1", True), ("1f1b", True), ("gpipe", True),
                                      ("1f1b", False)))
    assert zb < gp and f1b == pytest.approx(gp) and sync == pytest.approx(gp)
    single = t()
    assert single["comm_tensor"] == single["comm_pipe"] == single["comm_data"] == 0
    slow = dataclasses.replace(hw, axis_bandwidth=(("tensor", 1e9),))
    fast = dataclasses.replace(hw, axis_bandwidth=(("tensor", 1e10),))
    assert t(slow, tensor=4)["comm_tensor"] == pytest.approx(10 * t(fast, tensor=4)["comm_tensor"])
    assert 0 < t(tensor=4)["mfu"] < 1


def test_a_split_backward_that_records_its_inputs_hides_no_ring():
    """Collective matmuls hide the layers' rings behind their blocks' matmuls, but a
    zero-bubble split backward without remat records its weight ops' inputs and runs
    none (`Layout.records_weight_ops`; the GPU compiler overlapped 0% of llama3_8b's
    tensor bytes under ZB-V): the planner left them hidden and ranked ZB-V without
    remat (1.806 s) ahead of the 8B recipe's 1F1B (1.826 s). Under remat its W runs the
    backward's rings again (`Layout.split_recomputes`), which are counted and hidden as
    a fused backward's are (the same layers: the GPU compiler overlapped 99% of the 8B
    recipe's tensor bytes under ZB-V and ZB-H1 with save_dots, 2026-12-03)."""
    hw = planner.Hardware(memory_bytes=1e12, peak_flops=1e12)
    base = dict(pipeline=2, tensor=2, microbatches=4, sequence_parallel=True)
    par = lambda **kw: ParallelConfig(**base, **kw)
    t = lambda **kw: planner.predict_time(MODEL, par(**kw), TRAIN, hw)
    tensor = lambda **kw: comm_model.expected_bytes(MODEL, par(**kw), TRAIN)["tensor"] / \
        hw.bandwidth("tensor", par(**kw))
    for schedule in ("1f1b", "zb_v"):
        plain = t(schedule=schedule, remat="none")["comm_tensor"]
        assert plain == pytest.approx(tensor(schedule=schedule, remat="none"))
        fused = t(schedule=schedule, remat="none", collective_matmul=True)["comm_tensor"]
        assert fused == pytest.approx(plain) if schedule == "zb_v" else fused < 0.9 * plain
    split = tensor(schedule="zb_v", remat="save_dots")  # B's and W's rings: 7 units of 5
    assert split == pytest.approx(7 / 5 * tensor(schedule="1f1b", remat="save_dots"), rel=0.05)
    exposed = lambda schedule: t(schedule=schedule, remat="save_dots", collective_matmul=True)[
        "comm_tensor"] / tensor(schedule=schedule, remat="save_dots")
    assert 0 < exposed("zb_v") <= exposed("1f1b") < 0.1  # (1/7 of them alone: 0.17)


def test_keeping_the_gathered_inputs_saves_the_recompute_its_rings():
    """`save_dots_gathered` keeps sequence parallelism's gathered inputs: the recompute
    gathers nothing again (none's 4 ring units a layer against save_dots's 5), its
    rings are never alone, and its compute rate is save_dots's (the same matmuls), so
    with collective matmuls the planner's step is save_dots's less the exposed rings."""
    from framework.engine.resolved import REMATS

    hw = planner.Hardware(memory_bytes=1e12, peak_flops=1e12, device="NVIDIA H200")
    base = dict(pipeline=2, tensor=2, microbatches=4, sequence_parallel=True,
                collective_matmul=True)
    t = lambda remat: planner.predict_time(MODEL, ParallelConfig(**base, remat=remat), TRAIN, hw)
    tensor = lambda remat: comm_model.expected_bytes(
        MODEL, ParallelConfig(**base, remat=remat), TRAIN)["tensor"]
    assert tensor("save_dots_gathered") == pytest.approx(tensor("none"))
    assert tensor("save_dots_gathered") == pytest.approx(4 / 5 * tensor("save_dots"), rel=0.05)
    assert not REMATS["save_dots_gathered"].rings_alone and not REMATS["save_dots"].rings_alone
    kept, dots = t("save_dots_gathered"), t("save_dots")
    assert kept["rate"] == dots["rate"] and kept["compute"] == dots["compute"]
    assert kept["comm_tensor"] < dots["comm_tensor"]


def test_the_time_of_each_layout_counts_its_own_bytes():
    """The planner's communication bytes are cached per layout; a key that left out
    ZeRO-1 / FSDP and the microbatches gave FSDP (gathering per microbatch) ZeRO-1's
    data bytes and every microbatch count the first one's sends: `tools/plan.py` then
    ranked FSDP at 70B as fast as ZeRO-1 (5.49 s; with its gathers 6.72 s)."""
    hw = planner.Hardware(memory_bytes=1e12, peak_flops=1e12)
    layouts = [ParallelConfig(pipeline=2, data=2, microbatches=m, schedule="1f1b",
                              zero1=not fsdp, fsdp=fsdp)
               for fsdp in (False, True) for m in (2, 4)]
    for par in layouts:  # the ZeRO-1 layouts first, as the planner enumerates them
        got = planner.predict_time(MODEL, par, TRAIN, hw)
        want = comm_model.expected_bytes(MODEL, par, TRAIN)
        assert got["comm_data"] == pytest.approx(want["data"] / hw.bandwidth("data", par))
    zero1, fsdp = (planner.predict_time(MODEL, layouts[k], TRAIN, hw) for k in (1, 3))
    assert fsdp["comm_data"] > 2 * zero1["comm_data"]


@pytest.mark.slow  # ~11 s
def test_plan_command_line(capsys):
    from tools import plan

    assert plan.main(["recipe=llama_tiny_debug", "devices=8", "device_memory_gb=0.003",
                      "top=4", "unfit=2"]) == 0
    out = capsys.readouterr().out
    assert "valid layouts" in out and " yes " in out and " NO " in out
    assert "the recipe's own layout (pp2-dp2-tp2-mb2)" in out
    assert "with a pipeline: " in out and "without a pipeline: " in out
    # ZeRO-1 with one data replica (the 8B recipe's) is ranked as the unsharded layout
    assert plan.main(["recipe=llama_tiny_debug", "devices=8", "device_memory_gb=80", "top=1",
                      "parallel.pipeline=4", "parallel.data=1", "parallel.microbatches=4",
                      "parallel.zero1=true"]) == 0
    assert "the recipe's own layout (pp4-dp1-tp2-mb4)" in capsys.readouterr().out
    assert plan.main(["recipe=llama_tiny_debug", "devices=8"]) == 2
    assert "device_memory_gb" in capsys.readouterr().err
    # Settings out of range: one line naming the setting, before anything is planned
    # (they printed negative step times, and memory_fraction=2 let 141 GiB "fit" 80).
    for bad, valid in [("devices_per_node=0", ">= 1"), ("memory_fraction=2", "in (0, 1]"),
                       ("peak_tflops=-5", "> 0"), ("pipe_gbps=0", "> 0")]:
        assert plan.main(["recipe=llama_tiny_debug", "devices=8", "device_memory_gb=80",
                          bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and bad.split("=")[0] in err and valid in err, err


def test_the_plan_says_whether_a_pipeline_wins():
    """Issue 43: the fastest fitting layout with a pipeline against the fastest without
    one, by rank and step time; a layout that does not fit is never the verdict's."""
    from tools import plan

    def layout(pp, seconds, fits=True):
        par = ParallelConfig(pipeline=pp, data=8 // pp, microbatches=4 if pp > 1 else 2)
        return planner.Plan(par, {}, {"total": seconds}, fits, 1)

    line = plan.pipeline_verdict([layout(1, 0.9, fits=False), layout(2, 1.0), layout(2, 1.1),
                                  layout(1, 1.05)])
    assert line == ("with a pipeline: pp2-dp4-tp1-mb4 ranks 2, 1000 ms; without a pipeline: "
                    "pp1-dp8-tp1-mb2 ranks 4, 1050 ms: the pipeline is 5.0% faster")
    assert plan.pipeline_verdict([layout(1, 1.0), layout(2, 1.2)]).endswith(
        "the layout without one is 20.0% faster")
    assert plan.pipeline_verdict([layout(2, 1.0)]).endswith("no layout without a pipeline fits")


def test_uneven_stages_are_planned_and_the_head_stage_gets_fewer_layers():
    """30 layers on 4 stages: the enumeration plans them with `auto`, whose balance
    (the LM head's FLOPs counted) is faster than an explicit symmetric split."""
    model = dataclasses.replace(MODEL, n_layers=30, vocab_size=4096)
    found = planner.enumerate_layouts(model, TRAIN, 8, ParallelConfig(), schedules=["1f1b"])
    assert {p.stage_layers for p in found if p.pipeline == 4} == {"auto"}
    assert {p.stage_layers for p in found if p.pipeline == 2} == {None}  # 15 + 15
    hw = planner.Hardware(memory_bytes=1e12, peak_flops=1e12)
    t = lambda counts: planner.predict_time(model, ParallelConfig(
        pipeline=4, microbatches=8, schedule="1f1b", stage_layers=counts), TRAIN, hw)
    assert t("auto")["compute"] < t((7, 8, 8, 7))["compute"] < t((9, 7, 7, 7))["compute"]


@pytest.mark.slow
def test_plan_verify_compiles_the_best_candidates_for_the_target(capsys):
    """--verify: the top candidates compiled by the GPU compiler (devices and memory
    from the target), ranked by the compiler's verdict, then the predicted time."""
    from tools import plan

    assert plan.main(["recipe=llama_tiny_debug", "--verify", "target=gpu:h100x8",
                      "verify_top=2", "top=2", "unfit=0"]) == 0
    out = capsys.readouterr().out
    assert "verified by the gpu:h100x8 compiler" in out and out.count(" yes ") >= 4
    assert "picked: pp" in out
    assert plan.main(["recipe=llama_tiny_debug", "--verify"]) == 2
    assert "target=" in capsys.readouterr().err
    assert plan.main(["recipe=llama_tiny_debug", "--verify", "target=gpu:h100x8",
                      "devices=16"]) == 2
    assert "has 8" in capsys.readouterr().err
    # a TPU target's device prices the compute (not an H100); one without a known peak
    # asks for it
    assert plan.main(["recipe=llama_tiny_debug", "--verify", "target=tpu:v6e-8"]) == 2
    assert "peak_tflops=" in capsys.readouterr().err
    hw = plan.hardware({"device_memory_gb": 95.0}, "bfloat16",
                       targets.parse("tpu:v5p-16"))
    assert hw.peak_flops == 459e12 and hw.platform == "tpu"


def test_verify_table_reads_a_layout_without_pipeline():
    """A verified layout without a pipeline has no stage-to-stage sends: its share is
    None in the report, a dash in the table (it was a TypeError)."""
    from tools import plan_verify

    hw = planner.Hardware(memory_bytes=1e12, peak_flops=1e12)
    best = planner.plan(MODEL, TRAIN, ParallelConfig(), 1, hw)[0]
    row = plan_verify.Verified(best, 2**30, True, {"pipe_sends": None, "tensor": None}, 1.0)
    assert " - " in plan_verify.table([row], "gpu:h100x1").splitlines()[3]


def test_one_device_ranks_one_microbatch_first_and_accumulation_where_only_it_fits():
    """Without a pipeline every number of microbatches takes the same predicted time
    (no bubble): one microbatch ranks first where it fits, accumulation where only it
    fits (the smaller memory)."""
    roomy = planner.Hardware(memory_bytes=1e12, peak_flops=1e12)
    plans = planner.plan(MODEL, TRAIN, ParallelConfig(), 1, roomy)
    assert [pl.parallel.microbatches for pl in plans][:2] == [1, 2]
    assert plans[0].time["total"] == plans[1].time["total"]
    assert plans[0].memory["total"] > plans[-1].memory["total"]  # (accumulating holds less)
    tight = planner.Hardware(memory_bytes=plans[1].memory["total"], peak_flops=1e12,
                             memory_fraction=1.0)
    first = planner.plan(MODEL, TRAIN, ParallelConfig(), 1, tight)[0]
    assert first.fits and first.parallel.microbatches > 1


def test_accumulation_costs_time_at_the_memory_bandwidth():
    """Given the device's memory bandwidth, each accumulated microbatch's adds cost time
    (framework/analysis/accumulation.py): without a pipeline one microbatch is faster
    than two, and the term grows with the microbatches; a pipeline's term counts its
    microbatches too. Without a bandwidth (nor a catalogued device) it is not priced."""
    hbm = planner.Hardware(memory_bytes=1e12, peak_flops=1e12, memory_bandwidth=1e9)
    t = lambda **kw: planner.predict_time(MODEL, ParallelConfig(**kw), TRAIN, hbm)
    one, two, four = (t(microbatches=m) for m in (1, 2, 4))
    assert one["accumulate"] == 0 < two["accumulate"] and one["total"] < two["total"]
    assert four["accumulate"] == pytest.approx(2 * two["accumulate"])
    pp = [t(pipeline=2, microbatches=m, schedule="1f1b") for m in (2, 4)]
    assert pp[1]["accumulate"] == pytest.approx(2 * pp[0]["accumulate"])
    assert pp[0]["stage"] > pp[0]["accumulate"] > 0  # (the head's rank's cells hold it)
    plain = planner.Hardware(memory_bytes=1e12, peak_flops=1e12)
    assert planner.predict_time(MODEL, ParallelConfig(microbatches=2), TRAIN,
                                plain)["accumulate"] == 0
    h100 = dataclasses.replace(plain, device="NVIDIA H100 80GB HBM3")
    assert h100.hbm == 3.35e12


@pytest.mark.slow  # fast tier <= 5 min (2026-11-28: 3 s)
def test_long_sequences_bring_context_layouts_whose_activations_shrink():
    """Context degrees enter the enumeration where each device keeps at least
    MIN_CONTEXT_TOKENS of a sequence; a layout's predicted activations fall with the
    degree at the same data degree (each device holds 1/context of every sequence)."""
    long = dataclasses.replace(TRAIN, seq_len=4 * planner.MIN_CONTEXT_TOKENS,
                               global_batch_size=8)
    base = ParallelConfig()
    assert {p.context for p in planner.enumerate_layouts(MODEL, long, 8, base)} == {1, 2, 4}
    assert {p.context for p in planner.enumerate_layouts(MODEL, TRAIN, 8, base)} == {1}
    acts = {c: memory_model.predict_memory(MODEL, ParallelConfig(context=c),
                                           long)["activations"] for c in (1, 2, 4)}
    assert acts[4] < 0.3 * acts[1] and acts[2] < 0.55 * acts[1], acts


def test_combined_cells_hide_their_share_of_the_expert_exchange_and_keep_every_schedule():
    """parallel.combined_1f1b: the planner hides the expert exchange of the combined
    cells (Program.fused_share of it) up to the compute, not the rest; enumerated from a
    base with it on, the schedules that cannot run combined stay in the table (without)."""
    from framework.config import MoeConfig

    model = dataclasses.replace(MODEL, family="mixtral", moe=MoeConfig(experts=4, top_k=2))
    hw = planner.Hardware(memory_bytes=1e12, peak_flops=1e12)
    par = ParallelConfig(pipeline=2, data=2, expert=2, microbatches=8, schedule="1f1b")
    apart, both = (planner.predict_time(model, dataclasses.replace(par, combined_1f1b=c),
                                        TRAIN, hw) for c in (False, True))
    share = 6 / 8  # at p 2, m 8: the two warm-up forwards of each rank run alone
    assert both["comm_expert"] == pytest.approx(apart["comm_expert"] * (1 - share))
    assert both["compute"] == apart["compute"]
    layouts = planner.enumerate_layouts(model, TRAIN, 4, dataclasses.replace(
        par, combined_1f1b=True))
    names = {(p.schedule, p.combined_1f1b) for p in layouts if p.pipeline > 1}
    assert ("1f1b", True) in names and ("zb_h1", False) in names and ("gpipe", False) in names
    assert not any(c for s, c in names if s not in ("1f1b", "interleaved_1f1b"))
