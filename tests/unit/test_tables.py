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
from framework.parallel.pipeline.schedule import BW, B, F, IDLE, W, make_schedule

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
                    assert ((s.kind == k).sum(axis=0) == m * s.n_chunks).all(), (name, p, m, v, k)


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


def test_zb_v_halves_zb_h1s_bubble_in_1f1b_memory():
    """ZB-V (two chunks per rank in V order): the ramp's p-1 idle ticks over 6m + p - 1,
    below ZB-H1's at every size, with at most 2p chunk-microbatches (p stages' worth)
    in flight per rank; the turn at the bottom of the V stays on the last rank."""
    for p, m in [(2, 8), (4, 8), (4, 16), (8, 16), (8, 32), (3, 6)]:
        zv, zh = make_schedule("zb_v", p, m), make_schedule("zb_h1", p, m)
        assert zv.bubble_fraction < zh.bubble_fraction
        assert zv.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
        assert zv.max_in_flight().max() <= 2 * p
        assert [list(row) for row in zv.stage_of] == [[r, 2 * p - 1 - r] for r in range(p)]
        plan = buffers_lib.plan(zv)
        turn = [pair for c in plan.channels if c.buffer == "act" and c.shift == 0
                for k in c.pairs for pair in k]
        assert turn == [(p - 1, p - 1)]  # stage p-1 -> p: no send


def test_the_v_layout_puts_each_layer_chunk_where_its_stage_runs():
    from framework.parallel.pipeline import layout
    p, lc = 4, 2
    layers = np.arange(2 * p * lc)  # layer k holds k
    stages = layout.to_stages(layers, p, 2, v_shape=True)  # [rank, chunk, layer]
    placement = make_schedule("zb_v", p, 8).stage_of
    for r in range(p):
        for c in range(2):
            g = placement[r, c]
            assert list(stages[r, c]) == list(range(g * lc, (g + 1) * lc))
    assert (layout.to_layers(stages, v_shape=True) == layers).all()


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


@pytest.mark.parametrize("sched,v", [("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)])
def test_the_chart_shows_every_cell_of_the_table(sched, v, tmp_path):
    """Reads the drawn chart back pixel by pixel: each (tick, rank) cell's colour near its
    corner (away from its label) is its kind's colour, and white where the table idles."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    from tools.schedule_plot import COLORS, _draw_table, draw

    s = make_schedule(sched, 2, 4, v)
    draw(s, str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"
    fig, ax = plt.subplots(figsize=(0.6 * s.n_ticks + 1, 2.5))
    _draw_table(ax, s)
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3] / 255.0
    palette = {IDLE: (1.0, 1.0, 1.0), **{k: to_rgb(c) for k, c in COLORS.items()}}
    seen = np.zeros_like(s.kind)
    for (t, r), _ in np.ndenumerate(s.kind):
        x, y = ax.transData.transform((t + 0.2, r + 0.2))
        colour = pixels[pixels.shape[0] - int(round(y)), int(round(x))]
        seen[t, r] = min(palette, key=lambda k: np.abs(np.array(palette[k]) - colour).sum())
    plt.close(fig)
    np.testing.assert_array_equal(seen, s.kind)
