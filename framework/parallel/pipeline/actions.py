"""Schedules as per-rank action lists: torch.pipelining's CSV format at the boundary.

torch.distributed.pipelining writes a compute-only schedule as one CSV row per rank and
one entry per time step, `{stage}{type}{microbatch}` with type F (forward), I (backward
w.r.t. the input), W (backward w.r.t. the weights) or B (the full backward), and an
empty entry where the rank idles. 1F1B on two ranks and two microbatches with
synchronous sends, and ZB-H1 there:

    0F0,0F1,,0B0,,0B1                 0F0,0F1,,0I0,0W0,0I1,0W1
    ,1F0,1B0,1F1,1B1,                 ,1F0,1I0,1F1,1I1,1W0,1W1

A kind's type is a field of its row (`CellKind.action`): F -> F, B -> I, W -> W, BW -> B.
A BW cut into parts (BWj, `kinds.py`) has none in torch: it is written
`{stage}B{microbatch}.{j}`, which torch's reader does not know (export such a table
whole: `parts=1`). Stages are global; a step is one lockstep tick, so a table
round-trips exactly (`from_actions(to_actions(s))`); what the rows do not say (the
sends, the executor, the closed form) is given when reading.

`from_actions` checks what it reads with the buffer plan's replay (`buffers.plan`): a
table whose order breaks the dependency rule, or that reads a message before it
arrives, is refused with a one-line ValueError.
"""

from __future__ import annotations

import csv
import io
import re

import numpy as np

from framework.parallel.pipeline import buffers
from framework.parallel.pipeline.kinds import IDLE, KINDS
from framework.parallel.pipeline.table import (INTERLEAVED, TICKS, V_SHAPE, Schedule,
                                               stage_map)

_ACTION = re.compile(r"^(\d+)([A-Z])(\d+)(?:\.(\d+))?$")
_KIND_OF = {(k.action, k.part): k for k in KINDS if k.action}  # (type, part) -> kind


def to_actions(s: Schedule) -> list[list[str]]:
    """Per rank, per tick: the cell as an action ("" where the rank idles)."""
    stage = s.global_stage
    out = [[""] * s.n_ticks for _ in range(s.n_stages)]
    for (t, r), code in np.ndenumerate(s.kind):
        if code != IDLE:
            kind = KINDS[code]
            part = "" if kind.part is None else f".{kind.part}"
            out[r][t] = f"{stage[t, r]}{kind.action}{s.microbatch[t, r]}{part}"
    return out


def _parse(rows: list[list[str]], name: str) -> np.ndarray:
    """[ticks, ranks, (kind, microbatch, global stage)] of the actions (idle: zeros)."""
    ticks = max((len(row) for row in rows), default=0)
    cells = np.zeros((ticks, len(rows), 3), np.int32)
    for r, row in enumerate(rows):
        for t, entry in enumerate(row):
            if not entry.strip():
                continue
            found = _ACTION.match(entry.strip())
            part = None if found is None or found[4] is None else int(found[4])
            kind = _KIND_OF.get((found[2], part)) if found else None
            if kind is None:
                raise ValueError(f"schedule {name}: rank {r}, step {t}: {entry!r} is not an "
                                 f"action (stage, F, I, W or B, microbatch[.part])")
            cells[t, r] = kind.code, int(found[3]), int(found[1])
    return cells


def _placement(cells: np.ndarray, p: int, v: int, name: str) -> str:
    """The stage map whose ranks hold the stages each row runs: interleaved, or a V."""
    busy = cells[..., 0] != IDLE
    for placement in (INTERLEAVED, V_SHAPE) if v == 2 else (INTERLEAVED,):
        rank = stage_map(placement, p, v).rank
        if (rank[cells[..., 2][busy]] == np.nonzero(busy)[1]).all():
            return placement
    raise ValueError(f"schedule {name}: its ranks hold stages neither interleaved (stage "
                     f"c*p + r on rank r) nor in a V (r and 2p-1-r)")


def from_actions(rows: list[list[str]], name: str = "actions", microbatches: int = 0,
                 overlap: bool = False, executor: str = TICKS,
                 formula: float = float("nan")) -> Schedule:
    """The table of per-rank action lists `rows` (one per rank; shorter rows idle at
    the end), checked (`buffers.plan`). `microbatches`: 0 for the largest it names + 1;
    `overlap`: its sends overlap the next tick (`Schedule.overlap`); `executor`: who runs
    it (AUTODIFF: the table's forward rows, autodiff the rest); `formula`: its closed-form
    bubble, if it has one."""
    cells = _parse(rows, name)
    busy = cells[..., 0] != IDLE
    if not busy.any():
        raise ValueError(f"schedule {name}: no actions")
    p, S = len(rows), int(cells[..., 2][busy].max()) + 1
    m = microbatches or int(cells[..., 1][busy].max()) + 1
    if S % p or int(cells[..., 1][busy].max()) >= m:
        raise ValueError(f"schedule {name}: {S} stages on {p} ranks, microbatches up to "
                         f"{int(cells[..., 1][busy].max())} of {m}: not a table of whole "
                         f"chunks per rank and its microbatches")
    v = S // p
    placement = _placement(cells, p, v, name)
    chunk = np.where(busy, stage_map(placement, p, v).chunk[cells[..., 2]], 0)
    parts = max((KINDS[k].part + 1 for k in np.unique(cells[..., 0])
                 if KINDS[k].part is not None), default=1)
    s = Schedule(name, p, m, v, cells[..., 0], np.where(busy, cells[..., 1], 0),
                 chunk.astype(np.int32), formula, executor, placement, overlap, parts)
    buffers.plan(s)  # raises ValueError, one line, unless the table replays cleanly
    return s


def to_csv(s: Schedule) -> str:
    """The table as torch.pipelining's compute-only CSV: a row per rank."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(to_actions(s))
    return out.getvalue()


def from_csv(text: str, **kwargs) -> Schedule:
    """The table of a compute-only CSV (`from_actions` says which keywords)."""
    return from_actions([row for row in csv.reader(io.StringIO(text))], **kwargs)
