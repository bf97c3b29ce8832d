"""The lockstep simulator behind every tick-loop schedule: per-rank programs (ordered
lists of cells) -> a table, each cell at the first tick the dependency rule
(`kinds.needs`) and the sends allow.

Sends that overlap compute (`overlap`, `parallel.overlap_sends`). A synchronous send
sits between two ticks: a message sent at tick t is usable at t+1, and no compute runs
while it travels. An overlapped send travels during the sender's next tick
(`framework/parallel/pipeline/ticks.py`), so a message to another rank is usable at t+2
(to itself still at t+1; `kinds.stored_at`). Ticks then come in pairs, a forward tick
and a backward tick, each kind in the one its row names (`CellKind.phase`: F forward, B,
BW and its parts backward, W either): the activations travel during the backward tick
and the gradients during the next forward tick, and each hop costs one pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from framework.parallel.pipeline.kinds import (FREES_STASH, IDLE, KINDS, STASHES, B, F, W,
                                               Work, dependents, needs, stored_at, units)
from framework.parallel.pipeline.table import INTERLEAVED, Schedule, StageMap, stage_map

Cell = tuple[int, int, int]  # (kind, microbatch, chunk): one entry of a rank's program


@dataclass(frozen=True)
class Clock:
    """When a cell may run in a lockstep table: once what it needs is usable (the tick
    after the one its message is stored at, `stored_at`; a cell's own units need
    nothing of each other), and with overlapped sends only in the tick of a pair its
    kind runs in (`CellKind.phase`: forward ticks even, backward ticks odd)."""

    stages: StageMap
    overlap: bool
    parts: int = 1  # the table's BWs are cut into this many cells (`table.needs`)

    @staticmethod
    def of(p: int, v: int = 1, overlap: bool = False, placement: str = INTERLEAVED,
           parts: int = 1) -> "Clock":
        """The clock of p ranks with v chunks each, placed by `placement`."""
        return Clock(stage_map(placement, p, v), overlap, parts)

    def work(self, cell: Cell, r: int) -> list[Work]:
        """The units of work (kind, microbatch, global stage) cell `cell` on rank r does."""
        kind, i, c = cell
        return [(k, i, int(self.stages.of[r, c])) for k in units(kind)]

    def ready(self, cell: Cell, r: int, t: int, done: dict) -> bool:
        kind, i, c = cell
        phase = KINDS[kind].phase
        if self.overlap and phase is not None and phase != t % 2:
            return False
        S, own = self.stages.n_stages, self.work(cell, r)
        for k, _, g in own:
            for need in needs(k, i, g, S, self.parts):
                if need.work in own:
                    continue  # a BW's own B
                src = int(self.stages.rank[need.work[2]])
                if stored_at(done.get(need.work, t), src, r, self.overlap) >= t:
                    return False
        return True


def simulate(name: str, m: int, programs: list[list[Cell]], formula: float,
             clock: Clock) -> Schedule:
    """Runs each rank's program in lockstep ticks, each cell at the first tick `clock`
    allows (its stage map, sends and parts). Raises if the programs deadlock."""
    p, v = clock.stages.of.shape
    overlap, placement = clock.overlap, clock.stages.placement
    done: dict[Work, int] = {}
    pc = [0] * p
    rows: list[list] = []
    while any(pc[r] < len(programs[r]) for r in range(p)):
        t = len(rows)
        row = [programs[r][pc[r]] if pc[r] < len(programs[r]) and clock.ready(
            programs[r][pc[r]], r, t, done) else None for r in range(p)]
        if t >= 3 and not any(any(cells) for cells in rows[-3:] + [row]):
            raise RuntimeError(f"schedule {name} deadlocks at tick {t} (p={p}, m={m}, v={v})")
        for r, cell in enumerate(row):
            if cell is not None:
                done.update(dict.fromkeys(clock.work(cell, r), t))
                pc[r] += 1
        rows.append(row)
    if overlap and len(rows) % 2:  # whole (forward, backward) pairs
        rows.append([None] * p)
    grid = np.array([[cell or (IDLE, 0, 0) for cell in row] for row in rows], np.int32)
    return Schedule(name, p, m, v, grid[..., 0], grid[..., 1], grid[..., 2], formula,
                    placement=placement, overlap=overlap, parts=clock.parts)


def greedy_programs(p: int, m: int, v: int, placement: str, limit: int,
                    overlap: bool = False) -> list[list[Cell]]:
    """Per-rank programs from lockstep list scheduling: every tick each rank runs the
    first of its ready cells (`Clock`) by priority: a B (the oldest microbatch, the
    later stage first: the backward is the critical path), else an F while fewer than
    `limit` chunk-microbatches are in flight on the rank (the later stage first), else
    the oldest W. `simulate` then builds the table from them. A cell is looked at only
    once what it needs has run (`table.dependents`), so a tick costs what is nearly
    ready."""
    stages = stage_map(placement, p, v)
    clock, S = Clock(stages, overlap), stages.n_stages
    after = dependents(m, S)
    done: dict[Work, int] = {}
    waiting: list[set] = [set() for _ in range(p)]  # cells whose needs have all run
    for i in range(m):
        waiting[stages.rank[0]].add((F, i, int(stages.chunk[0])))
    programs: list[list[Cell]] = [[] for _ in range(p)]
    in_flight = [0] * p
    t, quiet, left = 0, 0, 3 * m * v * p
    while left:
        picked = [_pick(waiting[r], r, t, done, clock, in_flight[r] < limit) for r in range(p)]
        quiet = 0 if any(picked) else quiet + 1
        if quiet > 3:
            raise RuntimeError(f"greedy schedule deadlocks at tick {t} (p={p}, m={m})")
        for r, cell in enumerate(picked):
            if cell is None:
                continue
            waiting[r].discard(cell)
            programs[r].append(cell)
            (work,) = clock.work(cell, r)
            done[work] = t
            in_flight[r] += int(STASHES[cell[0]]) - int(FREES_STASH[cell[0]])
            left -= 1
            for k, i, g in after.get(work, ()):
                if all(need.work in done for need in needs(k, i, g, S)):
                    waiting[stages.rank[g]].add((k, i, int(stages.chunk[g])))
        t += 1
    return programs


def _pick(waiting: set, r: int, t: int, done: dict, clock: Clock, may_start: bool):
    """The cell rank r runs at tick t (`greedy_programs`' priorities), or None."""
    of = clock.stages.of[r]
    ready = [cell for cell in waiting if clock.ready(cell, r, t, done)]
    b = [c for c in ready if c[0] == B]
    f = [c for c in ready if c[0] == F] if may_start else []
    w = [c for c in ready if c[0] == W]
    order = (sorted(b, key=lambda c: (c[1], -of[c[2]])) +
             sorted(f, key=lambda c: (-of[c[2]], c[1])) +
             sorted(w, key=lambda c: done[B, c[1], of[c[2]]]))
    return order[0] if order else None
