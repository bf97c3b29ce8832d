"""Draws a pipeline schedule table as a Gantt chart.

    python tools/schedule_plot.py --schedule 1f1b --pipeline 4 --microbatches 8 -o 1f1b.png
    python tools/schedule_plot.py --schedule circular --pipeline 4 --microbatches 8 \\
        --virtual-stages 2 -o circular.png

Stages are rows, ticks are columns; forward cells are blue, backward cells orange,
each labelled with its microbatch (and chunk, for the circular schedule); idle cells
are left blank. The table drawn is the very one the engine executes
(`framework.pipeline.schedule`), so the bubble in the title is the engine's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from framework.pipeline.schedule import BWD, FWD, IDLE, SCHEDULE_NAMES, Schedule, make_schedule  # noqa: E402

COLORS = {FWD: "#4c78a8", BWD: "#f58518"}


def draw(schedule: Schedule, path: str) -> int:
    """Writes the chart to `path`; returns the number of idle cells it drew blank."""
    ticks, stages = schedule.action.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * ticks + 1.5), 0.5 * stages + 1.3))
    idle = 0
    for t in range(ticks):
        for s in range(stages):
            kind = int(schedule.action[t, s])
            if kind == IDLE:
                idle += 1
                continue
            ax.add_patch(Rectangle((t, s), 1, 1, facecolor=COLORS[kind], edgecolor="white"))
            label = str(schedule.microbatch[t, s])
            if schedule.n_chunks > 1:
                label += f".{schedule.chunk[t, s]}"
            ax.text(t + 0.5, s + 0.5, label, ha="center", va="center", color="white",
                    fontsize=7 if schedule.n_chunks > 1 else 8)
    ax.set_xlim(0, ticks)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(stages, 0)
    ax.set_yticks([s + 0.5 for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("tick")
    chunks = f", v={schedule.n_chunks}" if schedule.n_chunks > 1 else ""
    ax.set_title(f"{schedule.name}: p={stages}, m={schedule.n_microbatches}{chunks}, "
                 f"bubble {schedule.bubble_fraction:.1%} ({idle} idle of {ticks * stages} cells)")
    ax.legend(handles=[Patch(color=COLORS[FWD], label="forward"),
                       Patch(color=COLORS[BWD], label="backward")],
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if stages < 4 else -0.15), ncol=2,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return idle


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=SCHEDULE_NAMES, required=True)
    parser.add_argument("--pipeline", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("-o", "--output", default="schedule.png")
    args = parser.parse_args(argv)
    if args.pipeline < 1 or args.microbatches < 1 or args.virtual_stages < 1:
        parser.error("--pipeline, --microbatches and --virtual-stages must be >= 1")
    if args.schedule == "circular" and args.virtual_stages > 1 and args.microbatches < args.pipeline:
        parser.error("the circular schedule needs --microbatches >= --pipeline")
    schedule = make_schedule(args.schedule, args.pipeline, args.microbatches, args.virtual_stages)
    idle = draw(schedule, args.output)
    print(f"wrote {args.output}: {schedule.n_ticks} ticks x {args.pipeline} stages, "
          f"{idle} idle cells, bubble {schedule.bubble_fraction:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
