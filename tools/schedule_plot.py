"""Draws a pipeline schedule table as a Gantt chart, or what the devices of a run
actually did beside it.

    python tools/schedule_plot.py --schedule zb_h1 --pipeline 4 --microbatches 8 -o zb_h1.png
    python tools/schedule_plot.py --schedule interleaved_1f1b --pipeline 4 --microbatches 8 \\
        --virtual-stages 2 -o interleaved.png
    python tools/schedule_plot.py --schedule 1f1b --pipeline 4 --microbatches 8 --sync -o sync.png
    python tools/schedule_plot.py --trace outputs/<date>/<time> -o timeline.png
    python tools/schedule_plot.py --schedule zb_h1 --pipeline 4 --microbatches 8 --sync \\
        --csv zb_h1.csv -o zb_h1.png        # also its per-rank actions (torch.pipelining)
    python tools/schedule_plot.py --from-csv zb_h1.csv --sync -o loaded.png

Table: ranks are rows, ticks are columns; each cell in its kind's colour (F blue, B
orange, W green, fused BW red, its parts in shades of red: `kinds.CellKind.colour`),
labelled with its microbatch (and chunk, with virtual stages); idle cells are blank.
The table drawn is the very one the engine executes (`framework/parallel/pipeline/`).

Actions (`--csv`, `--from-csv`): the table as torch.pipelining's compute-only CSV, a
row per rank of `{stage}{F|I|W|B}{microbatch}` actions (empty: idle), written, or read
back and checked by the buffer plan (`framework/parallel/pipeline/actions.py`).

Trace (`--trace <run folder>`): the run's profiled steps (`profile.steps`), read from
the timeline its profile left (`profile/timeline.json`, `framework/analysis/profiling.py`): per
pipeline rank, the time each device spent in each kind of cell, in milliseconds, with
the schedule's table drawn above at the same scale of ticks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.runtime.quiet import import_jax  # noqa: E402

import_jax()  # before anything imports JAX: its plugins' start-up lines stay off stderr
from framework.parallel.pipeline.program import program  # noqa: E402
from framework.parallel.pipeline.schedule import schedule_names  # noqa: E402
from framework.parallel.pipeline.actions import from_csv, to_csv  # noqa: E402
from framework.parallel.pipeline.kinds import BY_NAME, IDLE, KINDS  # noqa: E402
from framework.parallel.pipeline.table import Schedule  # noqa: E402


def _draw_table(ax, schedule: Schedule) -> int:
    ticks, ranks = schedule.kind.shape
    idle = 0
    for t in range(ticks):
        for r in range(ranks):
            kind = int(schedule.kind[t, r])
            if kind == IDLE:
                idle += 1
                continue
            ax.add_patch(Rectangle((t, r), 1, 1, facecolor=KINDS[kind].colour,
                                   edgecolor="white"))
            label = str(schedule.microbatch[t, r])
            if schedule.n_chunks > 1:
                label += f".{schedule.chunk[t, r]}"
            ax.text(t + 0.5, r + 0.5, label, ha="center", va="center", color="white",
                    fontsize=6 if schedule.n_chunks > 1 or ticks > 40 else 8)
    ax.set_xlim(0, ticks)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(ranks, 0)
    ax.set_yticks([r + 0.5 for r in range(ranks)], [f"rank {r}" for r in range(ranks)])
    ax.set_xlabel("tick" + (" (pairs: forward, backward; sends overlap the next tick)"
                            if schedule.overlap else ""))
    if schedule.overlap:  # a faint line between the pairs of ticks
        for t in range(0, ticks + 1, 2):
            ax.axvline(t, color="0.85", linewidth=0.6, zorder=0)
    chunks = f", v={schedule.n_chunks}" if schedule.n_chunks > 1 else ""
    ax.set_title(f"{schedule.name}: p={ranks}, m={schedule.n_microbatches}{chunks}, table "
                 f"bubble {schedule.bubble_fraction:.1%} (unit costs; {idle} idle of "
                 f"{ticks * ranks} cells)")
    return idle


def _legend(fig, kinds):
    """A legend entry per kind (codes), in the kinds' order."""
    rows = [KINDS[k] for k in sorted(set(kinds) - {IDLE})]
    fig.legend(handles=[Patch(color=k.colour, label=k.label) for k in rows],
               loc="lower center", ncol=len(rows), frameon=False)


def draw(schedule: Schedule, path: str) -> int:
    """Writes the table's chart to `path`; returns the number of idle cells left blank."""
    ticks, ranks = schedule.kind.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * ticks + 1.5), 0.5 * ranks + 1.6))
    idle = _draw_table(ax, schedule)
    _legend(fig, np.unique(schedule.kind).tolist())
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return idle


def draw_trace(run_dir: str, path: str) -> dict:
    """The run's measured timeline under its table; returns the timeline record."""
    timeline = json.loads((Path(run_dir) / "profile" / "timeline.json").read_text())
    sched = timeline["schedule"]
    schedule = program(sched["name"], sched["pipeline"], sched["microbatches"],
                       sched["virtual_stages"], sched.get("overlap_sends", True),
                       parts=sched.get("parts", 1)).schedule
    ranks = schedule.n_stages
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7.0, 0.3 * schedule.n_ticks + 1.5),
                                                     ranks + 3.2))
    _draw_table(top, schedule)
    step = timeline["steps"][0]
    kinds_seen = set()
    for rank, intervals in enumerate(step["ranks"]):
        for start, end, kind in intervals:
            k = BY_NAME[kind]
            kinds_seen.add(k.code)
            bottom.add_patch(Rectangle((start, rank), end - start, 1, facecolor=k.colour,
                                       edgecolor="none"))
    span = max((e for ivs in step["ranks"] for _, e, _ in ivs), default=1.0)
    bottom.set_xlim(0, span)
    bottom.set_ylim(ranks, 0)
    bottom.set_yticks([r + 0.5 for r in range(ranks)], [f"rank {r}" for r in range(ranks)])
    bottom.set_xlabel("ms since the pipeline loop started (device " + step["devices"] + ")")
    timed = ", ".join(f"{b:.1%}" for b in timeline["bubble_timed_per_rank"])
    bottom.set_title(f"measured: bubble {timeline['bubble_timed']:.1%} (per rank {timed}), "
                     f"{timeline['platform']}")
    _legend(fig, kinds_seen | set(np.unique(schedule.kind).tolist()))
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return timeline


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=schedule_names())
    parser.add_argument("--pipeline", type=int)
    parser.add_argument("--microbatches", type=int)
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--sync", action="store_true",
                        help="synchronous sends (parallel.overlap_sends=false)")
    parser.add_argument("--parts", type=int, default=2, choices=(1, 2, 3),
                        help="with --sync, the cells 1F1B cuts each BW into (2; 3 under "
                             "parallel.remat=full; 1: whole BWs)")
    parser.add_argument("--csv", metavar="PATH",
                        help="also write the table as per-rank actions (torch.pipelining's "
                             "CSV: a row per rank, e.g. 0F0,1I0,1W0,0B1)")
    parser.add_argument("--from-csv", metavar="PATH",
                        help="draw the table of such a CSV instead (checked by the buffer "
                             "plan; its sends overlap unless --sync)")
    parser.add_argument("--trace", help="a run folder whose profile to draw")
    parser.add_argument("-o", "--output", default="schedule.png")
    return parser


def _table(args, parser) -> Schedule:
    """The table the arguments name: read from --from-csv, or a registered schedule's."""
    if args.from_csv:
        try:
            return from_csv(Path(args.from_csv).read_text(), name=Path(args.from_csv).stem,
                            microbatches=args.microbatches or 0, overlap=not args.sync)
        except (OSError, ValueError) as err:
            parser.error(f"--from-csv {args.from_csv}: {err}")
    if args.schedule is None or args.pipeline is None or args.microbatches is None:
        parser.error("give --schedule, --pipeline and --microbatches (or --from-csv, --trace)")
    from framework.parallel.pipeline.schedule import check
    problems = check(args.schedule, args.pipeline, args.microbatches, args.virtual_stages)
    if args.pipeline < 1 or args.microbatches < 1 or args.virtual_stages < 1 or problems:
        parser.error("; ".join(problems) or "--pipeline, --microbatches and "
                     "--virtual-stages must be >= 1")
    return program(args.schedule, args.pipeline, args.microbatches, args.virtual_stages,
                   overlap=not args.sync, parts=args.parts).schedule


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.trace:
        if not (Path(args.trace) / "profile" / "timeline.json").exists():
            parser.error(f"--trace {args.trace}: no profile/timeline.json there (was the run "
                         f"profiled? profile.steps > 0 and enough train.steps)")
        timeline = draw_trace(args.trace, args.output)
        print(f"wrote {args.output}: bubble measured {timeline['bubble_timed']:.4f}, "
              f"table {timeline['bubble_table']:.4f}")
        return 0
    schedule = _table(args, parser)
    idle = draw(schedule, args.output)
    print(f"wrote {args.output}: {schedule.n_ticks} ticks x {schedule.n_stages} ranks, "
          f"{idle} idle cells, table bubble {schedule.bubble_fraction:.4f}")
    if args.csv:
        Path(args.csv).write_text(to_csv(schedule))
        print(f"wrote {args.csv}: {schedule.n_stages} ranks' actions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
