"""Pipeline schedule tables (framework/parallel/pipeline/schedule.py), their buffer
plans (buffers.py) and the chart of a table (tools/schedule_plot.py): no device runs here.
Parity of every schedule with the reference: tests/parity/test_schedules.py; their
compiled memory: tests/compiled/test_memory.py."""

import dataclasses

import matplotlib
import numpy as np
import pytest

from framework.parallel.pipeline import buffers as buffers_lib
from framework.parallel.pipeline import schedule as schedules
from framework.parallel.pipeline.kinds import BW, BW_PARTS, KINDS, B, F, W
from framework.parallel.pipeline.schedule import make_schedule

# --- Tables --------------------------------------------------------------------------

def test_every_registered_table_passes_its_check():
    for name in schedules.schedule_names():
        for p, m in [(1, 1), (1, 3), (2, 2), (2, 4), (4, 4), (4, 8), (3, 6), (4, 2)]:
            for v in (1, 2) if schedules.uses_virtual_stages(name) else (1,):
                if schedules.check(name, p, m, v):
                    continue
                for overlap, parts in ((True, 1), (False, 1), (False, 2), (False, 3)):
                    s = make_schedule(name, p, m, v, overlap, parts)
                    buffers_lib.plan(s)  # raises if a slot is overwritten while live
                    kinds = ((F, B, W) if s.split_backward else (F, BW) if s.parts == 1
                             else (F, *BW_PARTS[:s.parts]))
                    for k in kinds:  # each microbatch passes each stage once per kind
                        assert ((s.kind == k).sum(axis=0) == m * s.n_chunks).all(), (
                            name, p, m, v, overlap, k)


def _bubbles(name, v=1, overlap=True):
    return {(p, m): make_schedule(name, p, m, v, overlap).bubble_fraction
            for p in (2, 4, 8) for m in (8, 16, 32)}


def test_overlapped_1f1b_ticks_are_balanced_to_the_closed_form():
    """With sends overlapping compute every pair of ticks holds one F and one BW on
    every rank in the steady state: the lockstep table's bubble is the closed form
    (p-1)/(v m + p - 1) (Narayanan et al. 2021) at every size. Synchronous sends put
    a rank's F beside its neighbour's BW, which is why 1F1B's table idled more."""
    for name, v in [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)]:
        for (p, m), bubble in _bubbles(name, v).items():
            formula = (p - 1) / (v * m + p - 1)
            assert abs(bubble - formula) <= 0.01, (name, v, p, m, bubble, formula)
    synchronous = make_schedule("1f1b", 4, 8, overlap=False).bubble_fraction
    assert synchronous == pytest.approx(0.4)  # against 3/11 = 27.3%


def test_synchronous_1f1b_in_parts_is_at_the_closed_form_with_1f1b_memory():
    """With synchronous sends each BW is cut by layers into as many cells as it costs
    F's (2, or 3 under full remat): every lockstep tick then costs one F, and 1F1B's
    and interleaved 1F1B's tables reach their closed forms (p-1)/(v m + p - 1)
    (Narayanan et al. 2021) while rank 0 keeps p stages' worth of microbatches in
    flight (1F1B's memory; the whole BWs idled 40.0% at p 4, m 8, against 27.3%)."""
    for name, v in [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)]:
        for p in (2, 4, 8):
            for m in (8, 16, 32):
                for parts in (2, 3):
                    s = make_schedule(name, p, m, v, overlap=False, parts=parts)
                    assert s.parts == parts
                    assert s.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1)), (
                        name, v, p, m, parts)
                    assert s.max_in_flight()[0] == min(p * v, m * v), (name, v, p, m)
                    assert s.max_in_flight().max() <= p * v
    assert make_schedule("1f1b", 4, 8, overlap=True, parts=3).parts == 1  # paired ticks
    assert make_schedule("zb_h1", 4, 8, overlap=False, parts=3).parts == 1  # B, W apart


def test_overlapped_sends_arrive_a_tick_later_in_forward_and_backward_ticks():
    """F runs in forward (even) ticks, B and BW in backward (odd) ticks, a message to
    another rank is read two ticks after the tick that made it at the earliest (it
    travels during the next tick), and the check refuses a table that reads it sooner."""
    for name in schedules.schedule_names():
        v = 2 if schedules.uses_virtual_stages(name) else 1
        s = make_schedule(name, 4, 8, v)
        if s.executor != "ticks":
            assert not s.overlap  # GPipe and circular: synchronous sends
            continue
        ticks = np.arange(s.n_ticks)[:, None]
        assert s.overlap and s.n_ticks % 2 == 0
        assert not ((s.kind == F) & (ticks % 2 == 1)).any()
        assert not (np.isin(s.kind, (B, BW)) & (ticks % 2 == 0)).any()
        for msg in buffers_lib.plan(s).messages:
            assert msg.used - msg.sent >= (2 if msg.src != msg.dst else 1), (name, msg)
    early = dataclasses.replace(make_schedule("1f1b", 4, 8, overlap=False), overlap=True)
    with pytest.raises(ValueError, match="arrives at the end of tick"):
        buffers_lib.plan(early)


def test_zero_bubble_schedules_as_the_papers_predict():
    """Synchronous sends: ZB-H1 idles (p-1)(F+B-W) against 1F1B's (p-1)(F+B+W) (Qi et
    al. 2024, unit costs), ZB-V the same idle ticks over twice as many, and interleaving
    shrinks 1F1B's. Overlapped sends (a hop costs a pair of ticks): ZB-H1 still below
    1F1B, ZB-V at most ZB-H1's, and ZB-H1 on the closed form at p 2."""
    for p, m in [(2, 4), (4, 8), (4, 16), (8, 16)]:
        f1b, zb = (make_schedule(n, p, m, overlap=False) for n in ("1f1b", "zb_h1"))
        assert zb.bubble_fraction < f1b.bubble_fraction
        assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
        assert zb.n_ticks == 3 * m + p - 1
        for v in (1, 2, 4):
            s = make_schedule("interleaved_1f1b", p, m, v, overlap=False)
            assert s.n_ticks == 2 * v * m + 2 * (p - 1)
    for name in ("1f1b", "interleaved_1f1b"):  # interleaved with one chunk is 1F1B
        for overlap in (True, False):
            a = make_schedule("interleaved_1f1b", 4, 8, 1, overlap)
            b = make_schedule("1f1b", 4, 8, overlap=overlap)
            assert (a.kind == b.kind).all() and (a.microbatch == b.microbatch).all()
    for overlap in (True, False):
        f1b, h1, zv = (_bubbles(n, overlap=overlap) for n in ("1f1b", "zb_h1", "zb_v"))
        for key in f1b:
            assert zv[key] <= h1[key] < f1b[key], (overlap, key)
            if not overlap:
                p, m = key
                assert zv[key] < h1[key]
                assert zv[key] == pytest.approx((p - 1) / (6 * m + p - 1))
    for m in (8, 16, 32):
        assert _bubbles("zb_h1")[2, m] == pytest.approx(1 / (3 * m + 1))


def test_zb_v_places_its_stages_in_a_v():
    """Rank r holds stages r and 2p-1-r; the turn at the bottom of the V stays on the
    last rank (no send)."""
    for p, m in [(2, 8), (4, 8), (8, 16), (3, 6)]:
        for overlap in (True, False):
            zv = make_schedule("zb_v", p, m, overlap=overlap)
            assert [list(row) for row in zv.stages.of] == [[r, 2 * p - 1 - r] for r in range(p)]
            turn = [pair for c in buffers_lib.plan(zv).channels
                    if c.buffer == "act" and c.shift == 0 for k in c.pairs for pair in k]
            assert turn == [(p - 1, p - 1)]


def test_the_v_layout_puts_each_layer_chunk_where_its_stage_runs():
    from framework.parallel.pipeline import layout
    p, lc = 4, 2
    layers = np.arange(2 * p * lc)  # layer k holds k
    stages = layout.to_stages(layers, p, 2, v_shape=True)  # [rank, chunk, layer]
    placement = make_schedule("zb_v", p, 8).stages.of
    for r in range(p):
        for c in range(2):
            g = placement[r, c]
            assert list(stages[r, c]) == list(range(g * lc, (g + 1) * lc))
    assert (layout.to_layers(stages, v_shape=True) == layers).all()


def test_memory_in_flight_is_bounded_like_1f1b():
    """Synchronous: 1F1B's p-r microbatches on rank r, ZB-H1's p on each, ZB-V's 2p
    chunk-microbatches (p stages' worth). Overlapped: a round trip takes 2(p-1-r) pairs
    of ticks, so rank r holds 2(p-1-r)+1 (Megatron-LM's warm-up with overlapped sends),
    ZB-H1 2p, ZB-V 4p chunks."""
    for p, m in [(2, 8), (4, 16), (8, 16)]:
        one = lambda name, overlap, v=1: make_schedule(name, p, m, v, overlap).max_in_flight()
        assert list(one("1f1b", False)) == [p - r for r in range(p)]
        assert list(one("1f1b", True)) == [2 * (p - 1 - r) + 1 for r in range(p)]
        assert list(one("zb_h1", False)) == [p] * p
        assert one("zb_h1", True).max() <= 2 * p
        assert one("zb_v", False).max() <= 2 * p and one("zb_v", True).max() <= 4 * p
        # p*v chunk activations = p stages' worth, as 1F1B's first rank.
        assert one("interleaved_1f1b", False, 2).max() == 2 * p
        assert buffers_lib.plan(make_schedule("zb_h1", p, m, overlap=False)).n_slots["stash"] == p


def test_buffer_check_catches_an_overwritten_slot():
    s = make_schedule("1f1b", 4, 8, overlap=False)
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


@pytest.mark.parametrize("sched,v", [("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)])
def test_the_chart_shows_every_cell_of_the_table(sched, v, tmp_path):
    """Reads the drawn chart back pixel by pixel: each (tick, rank) cell's colour near its
    corner (away from its label) is its kind's colour, and white where the table idles."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    from tools.schedule_plot import _draw_table, draw

    s = make_schedule(sched, 2, 4, v)
    draw(s, str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"
    fig, ax = plt.subplots(figsize=(0.6 * s.n_ticks + 1, 2.5))
    _draw_table(ax, s)
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3] / 255.0
    palette = {k.code: to_rgb(k.colour) for k in KINDS}  # (idle: white)
    seen = np.zeros_like(s.kind)
    for (t, r), _ in np.ndenumerate(s.kind):
        x, y = ax.transData.transform((t + 0.2, r + 0.2))
        colour = pixels[pixels.shape[0] - int(round(y)), int(round(x))]
        seen[t, r] = min(palette, key=lambda k: np.abs(np.array(palette[k]) - colour).sum())
    plt.close(fig)
    np.testing.assert_array_equal(seen, s.kind)


def test_the_bubble_table_tool_prints_every_schedule_both_ways(capsys):
    """tools/bubble_table.py: a row per schedule and way of sending (GPipe and circular
    once: they send synchronously either way), each cell the table's bubble beside the
    closed form, read back from the printed Markdown."""
    from tests.helpers import load_tool

    assert load_tool("bubble_table").main(["--pipeline", "4", "--microbatches", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[2:]
    cells = {tuple(c.strip() for c in line.strip("|").split("|")[:2]):
             line.strip("|").split("|")[2].strip() for line in lines}
    ways = lambda n: (("synchronous",) if n in ("gpipe", "circular") else
                      ("overlapped", "synchronous, BW in parts", "synchronous, whole BWs")
                      if schedules.cuts_backward(n) else ("overlapped", "synchronous"))
    assert set(cells) == {(n + (" (v=2)" if schedules.uses_virtual_stages(n) else ""), s)
                          for n in schedules.schedule_names() for s in ways(n)}
    assert cells["1f1b", "overlapped"] == "27.3% (27.3%)"
    assert cells["1f1b", "synchronous, BW in parts"] == "27.3% (27.3%)"
    assert cells["1f1b", "synchronous, whole BWs"] == "40.0% (27.3%)"


def test_zb_v_ships_with_synchronous_sends_below_zb_h1_and_sends_no_zeros():
    """With parallel.overlap_sends unset each schedule sends its own way: ZB-V
    synchronously, so its table bubble is below ZB-H1's (overlapped) at every size of
    the grid, and its pipe carries exactly the messages the math needs: each
    microbatch's activation and gradient across every rank boundary once (overlapped
    sends carried zeros from ranks with nothing to send, up to 3x the bytes)."""
    from framework.config import ParallelConfig
    from framework.engine.resolved import overlapped
    from framework.parallel.pipeline.program import program

    assert not overlapped(ParallelConfig(schedule="zb_v"))
    assert overlapped(ParallelConfig(schedule="zb_h1"))
    assert not overlapped(ParallelConfig(schedule="zb_h1", overlap_sends=False))
    for p in (2, 4, 8):
        for m in (8, 16, 32):
            zv, zh = (program(n, p, m, 1, overlapped(ParallelConfig(schedule=n)))
                      for n in ("zb_v", "zb_h1"))
            assert zv.schedule.bubble_fraction < zh.schedule.bubble_fraction, (p, m)
            assert zv.sends_per_step == 2 * m * zv.stages.crossings(), (p, m)


# --- Per-rank action lists (torch.pipelining's CSV) --------------------------------------

def test_every_table_round_trips_through_per_rank_actions():
    """Every registered table written as torch.pipelining's CSV (a row per rank of
    `{stage}{F|I|W|B}{microbatch}`, BW parts with a `.j` suffix) reads back as the same
    table, checked by the buffer plan."""
    from framework.parallel.pipeline.actions import from_csv, to_csv

    for name in schedules.schedule_names():
        for p, m in [(1, 2), (2, 4), (4, 8), (3, 6)]:
            for v in (1, 2) if schedules.uses_virtual_stages(name) else (1,):
                if schedules.check(name, p, m, v):
                    continue
                for overlap, parts in ((True, 1), (False, 1), (False, 2), (False, 3)):
                    s = make_schedule(name, p, m, v, overlap, parts)
                    back = from_csv(to_csv(s), name=s.name, microbatches=m,
                                    overlap=s.overlap, executor=s.executor)
                    for field in ("kind", "microbatch", "chunk"):
                        np.testing.assert_array_equal(getattr(back, field), getattr(s, field))
                    assert (back.n_chunks, back.parts) == (s.n_chunks, s.parts)
                    np.testing.assert_array_equal(back.stages.of, s.stages.of)  # (p 1: V
                    #                                    and interleaved are the same map)
                    assert to_csv(back) == to_csv(s)


def test_actions_read_torch_pipelinings_letters():
    """Our B is torch's I (the input gradient), our fused BW torch's B (full backward)."""
    from framework.parallel.pipeline.actions import from_csv, to_csv

    assert to_csv(make_schedule("1f1b", 2, 2, 1, False)) == "0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1,\n"
    zb = from_csv("0F0,0F1,,0I0,0W0,0I1,0W1\n,1F0,1I0,1F1,1I1,1W0,1W1\n")
    np.testing.assert_array_equal(zb.kind, make_schedule("zb_h1", 2, 2, 1, False).kind)
    parts = to_csv(make_schedule("1f1b", 2, 2, 1, False, parts=2)).split("\n")[0]
    assert parts == "0F0,0F1,,,0B0.1,0B0.0,,0B1.1,0B1.0", parts  # BW1 (top), then BW0


@pytest.mark.parametrize("edit,error", [
    ({(0, 3): "0W0", (0, 4): "0I0"}, "W\\(0, stage 0\\) at tick 3 runs before B\\(0, stage 0\\)"),
    ({(1, 1): "", (1, 0): "1F0"}, "runs before F\\(0, stage 0\\)"),
    ({(0, 4): ""}, "W\\(0, stage 0\\) is missing"),
    ({(0, 0): "0X0"}, "'0X0' is not an action"),
    ({(1, 1): "0F0"}, "neither interleaved"),
])
def test_actions_in_a_wrong_order_are_refused_in_one_line(edit, error):
    """The buffer plan's replay refuses a table that breaks the dependency rule."""
    from framework.parallel.pipeline.actions import from_actions, to_actions

    rows = to_actions(make_schedule("zb_h1", 2, 2, 1, False))
    for (r, t), action in edit.items():
        rows[r][t] = action
    with pytest.raises(ValueError, match=error) as err:
        from_actions(rows)
    assert "\n" not in str(err.value)
    sync = make_schedule("1f1b", 4, 8, 1, False)  # read as if its sends overlapped
    with pytest.raises(ValueError, match="arrives at the end of tick"):
        from_actions(to_actions(sync), overlap=True)


def test_planning_never_imports_execution():
    """The pipeline package's seam (its docstring): the host-side planning modules import
    no module of the device-side execution, at module level or inside a function."""
    import ast
    from pathlib import Path

    import framework.parallel.pipeline as pipeline

    root = Path(pipeline.__file__).parent
    planning = {"kinds", "table", "simulate", "schedule", "actions", "buffers", "program",
                "scopes", "layout"}
    execution = {p.stem for p in root.glob("*.py")} - planning - {"__init__"}
    assert execution == {"stage", "comm", "autodiff", "ticks", "cells", "lowering",
                         "tick_types", "stash"}
    for name in planning:
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "framework.parallel.pipeline"):
                imported = {node.module.rsplit(".", 1)[-1], *(a.name for a in node.names)}
                assert not imported & execution, (name, node.module)
