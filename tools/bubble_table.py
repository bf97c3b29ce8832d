"""Every registered schedule's table bubble against its paper's closed form, over a grid
of pipeline sizes and microbatch counts, with overlapped and with synchronous sends.

    python tools/bubble_table.py                          # p 2, 4, 8 x m 8, 16, 32
    python tools/bubble_table.py --pipeline 4 --microbatches 8 16 --virtual-stages 2 4

Nothing is compiled: the tables are the ones the engine runs (`program(...).schedule`), the
bubble is `Schedule.bubble_fraction` (lockstep ticks, unit-cost F = B = W, BW = 2, a
part of a BW cut in parts 1) and "in flight" the most microbatch-chunks a rank holds
between its F and its W (BW, BW0). With synchronous sends 1F1B and interleaved 1F1B cut
each BW into parts (2 here; 3 under full remat, the same bubble); the "whole BWs" rows
are the tables they ran before.
Markdown, one row per (schedule, virtual stages, sends); cells "table (closed form)".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.runtime.quiet import import_jax  # noqa: E402

import_jax()  # before anything imports JAX: its plugins' start-up lines stay off stderr
from framework.parallel.pipeline import schedule as schedules  # noqa: E402
from framework.parallel.pipeline.program import program  # noqa: E402


def rows(pipelines, microbatches, virtual_stages) -> list[str]:
    grid = [(p, m) for p in pipelines for m in microbatches]
    head = "| schedule | sends | " + " | ".join(f"p {p}, m {m}" for p, m in grid) + \
        " | in flight (most, p = {}) |".format(max(pipelines))
    out = [head, "|" + "---|" * (len(grid) + 3)]
    for name in schedules.schedule_names():
        chunks = virtual_stages if schedules.uses_virtual_stages(name) else (1,)
        for v in chunks:
            for overlap, parts in ((True, 1), (False, 2), (False, 1)):
                if parts == 1 and not overlap and schedules.cuts_backward(name):
                    sends = "synchronous, whole BWs"  # what 1F1B ran before its parts
                elif parts > 1 and not schedules.cuts_backward(name):
                    continue
                made = {(p, m): program(name, p, m, v, overlap, parts=parts).schedule
                        for p, m in grid if not schedules.check(name, p, m, v)}
                if not made:
                    continue
                if not next(iter(made.values())).overlap and overlap:
                    continue  # GPipe and circular: synchronous either way
                cells = [f"{100 * made[k].bubble_fraction:.1f}% ({100 * made[k].formula_bubble:.1f}%)"
                         if k in made else "-" for k in grid]
                widest = [s for (p, _), s in made.items() if p == max(pipelines)]
                flight = max(int(s.max_in_flight().max()) for s in widest) if widest else "-"
                label = name + (f" (v={v})" if schedules.uses_virtual_stages(name) else "")
                if not (parts == 1 and not overlap and schedules.cuts_backward(name)):
                    sends = ("overlapped" if overlap else "synchronous" +
                             (", BW in parts" if parts > 1 else ""))
                out.append(f"| {label} | {sends} | " + " | ".join(cells) + f" | {flight} |")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--virtual-stages", type=int, nargs="+", default=[2])
    args = parser.parse_args(argv)
    if min(args.pipeline + args.microbatches + args.virtual_stages) < 1:
        parser.error("--pipeline, --microbatches and --virtual-stages must be >= 1")
    print("\n".join(rows(args.pipeline, args.microbatches, args.virtual_stages)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
