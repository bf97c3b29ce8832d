"""A schedule compiled once into everything its readers need: the `Program`.

    program("1f1b", p=2, m=4, v=1, overlap=False)
      .schedule        the table: (tick, rank) -> cell (`table.py`, made by `schedule.py`)
      .stages          the stage map: global stage <-> (rank, chunk)
      .buffers         the buffer plan: stash and receive slots per cell, the sends per
                       tick and channel, checked by replaying the table (`buffers.py`)
      .scan_inputs()   what the executor's tick loop scans over, one row per tick
      .kinds(phase)    the cell kinds a tick of the loop's step can run (its branches)
      .scope_weights   per named scope of the executor's program, the share of the loop's
                       executions that run it (the communication audit weighs by it)
      .sends_per_step  messages put on the wire per step (the comm model, the planner)
      .real(stage)     uneven stages: how many of a chunk's layers are real
      .first(stage, n) the global index of a stage's first layer (sliding-window layers)

Both executors (`autodiff.py`, `ticks.py`), the memory and comm models, the audit, the
planner and the charts read a Program; nothing else derives any of these. Programs are
cached: one per (schedule, pipeline, microbatches, virtual stages, sends, stage layers).
The buffer plan is built when first read (at p 16, m 128 it takes a while, and the
planner only needs the table and the send count).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Optional

import jax.numpy as jnp
import numpy as np

from framework.parallel.pipeline import buffers as buffer_plan
from framework.parallel.pipeline.layout import stage_starts
from framework.parallel.pipeline.schedule import forward_only, make_schedule
from framework.parallel.pipeline.scopes import (CELL_SCOPES, ON_FIRST, ON_LAST, STAGE,
                                                send_scope)
from framework.parallel.pipeline.table import (AUTODIFF, IDLE, MAKES_DX, F, Schedule,
                                               StageMap)


@dataclass(frozen=True, eq=False)
class Program:
    schedule: Schedule
    stage_layers: Optional[tuple] = None  # real layers per global stage (None: even)

    @property
    def stages(self) -> StageMap:
        return self.schedule.stages

    @property
    def autodiff(self) -> bool:
        """GPipe and circular: the executor runs the forward rows, autodiff the rest."""
        return self.schedule.executor == AUTODIFF

    @cached_property
    def buffers(self) -> buffer_plan.Buffers:
        return buffer_plan.plan(self.schedule)

    @cached_property
    def sends_per_step(self) -> int:
        return buffer_plan.sends_per_step(self.schedule)

    def real(self, stage):
        """The real layers of global stage `stage`'s chunk (traced), None when even."""
        if self.stage_layers is None:
            return None
        return jnp.asarray(self.stage_layers, jnp.int32)[stage]

    def first(self, stage, per_chunk: int):
        """The global index of global stage `stage`'s first layer (traced): stage x
        per_chunk (the layers a chunk holds) when even, else the real layers of the
        stages before it (the stage layout's, layout.py)."""
        if self.stage_layers is None:
            return jnp.asarray(stage, jnp.int32) * per_chunk
        return jnp.asarray(stage_starts(self.stage_layers), jnp.int32)[stage]

    def kinds(self, phase: int) -> set:
        """The cell kinds tick `phase` of the loop's step runs somewhere in the table."""
        s = self.schedule
        return set(np.unique(s.kind[phase::s.ticks_per_step]).tolist()) - {IDLE}

    def scan_inputs(self) -> dict:
        """The rows the executor runs, as numpy arrays [ticks, ranks]: each rank's cell
        (kind, microbatch, chunk, global stage, first / last stage), its stash slot
        (tick executor) and read slot, and per channel the slot each rank stores an
        arriving message in and the tick's send pattern ([ticks])."""
        s, b = self.schedule.forward_rows(), self.buffers
        stage = s.global_stage
        rows = {"kind": s.kind, "mb": s.microbatch, "chunk": s.chunk, "stage": stage,
                "read": b.read, "first": stage == 0, "last": stage == s.n_global_stages - 1,
                "arrive": [ch.arrive for ch in b.channels],
                "pattern": [ch.pattern for ch in b.channels]}
        if not self.autodiff:
            rows["stash"] = b.stash
        return rows

    @cached_property
    def scope_weights(self) -> dict[str, float]:
        """Per named scope (`scopes.py`), the share of the loop body's executions on a
        device that run it. Tick executor: a kind's branch is in the dispatch of each
        tick of the step it may run in (`kinds`); the head runs on the m F cells of the
        last stage, the embedding's gradient on the m backward cells of the first.
        Autodiff executor: a rank is busy in its share of the forward rows' cells."""
        s, p, m = self.schedule, self.schedule.n_stages, self.schedule.n_microbatches
        if self.autodiff:
            weights = {ON_FIRST: 1 / p, ON_LAST: 1 / p,
                       STAGE: float((s.forward_rows().kind == F).mean())}
        else:
            steps = s.n_ticks // s.ticks_per_step
            dispatches = [self.kinds(phase) for phase in range(s.ticks_per_step)]
            weights = {CELL_SCOPES[k]: float((s.kind == k).sum()) / (
                steps * p * max(1, sum(k in d for d in dispatches))) for k in CELL_SCOPES}
            weights[ON_LAST] = m / max(int((s.kind == F).sum()), 1)
            weights[ON_FIRST] = m / max(int(np.isin(s.kind, MAKES_DX).sum()), 1)
        # Sends: per pattern, the share of ticks that send it (overlapped: every tick of
        # the loop's step it is in, unconditionally).
        weights.update({send_scope(ch, k): 1.0 if ch.overlap else float(np.mean(ch.pattern == k))
                        for ch in self.buffers.channels for k in range(1, len(ch.pairs))})
        return weights


@lru_cache(maxsize=None)
def program(name: str, pipeline: int, microbatches: int, virtual_stages: int = 1,
            overlap: bool = True, stage_layers: Optional[tuple] = None,
            parts: int = 1) -> Program:
    """The Program of `parallel.schedule` (raises ValueError for a bad combination: see
    `schedule.check`). `overlap`: `parallel.overlap_sends`; `stage_layers`: counts per
    global stage (resolved, not `auto`) or None; `parts`: the cells a BW is cut into
    where the schedule does that (a configuration's Program, with these resolved from
    its settings: `framework/engine/resolved.py`, `Layout.program`)."""
    schedule = make_schedule(name, pipeline, microbatches, virtual_stages, overlap, parts)
    layers = tuple(int(n) for n in stage_layers) if stage_layers is not None else None
    return Program(schedule, layers)


@lru_cache(maxsize=None)
def forward_program(prog: Program) -> Program:
    """What evaluation runs for `prog`'s layout: its own forward rows (autodiff
    schedules), or the forward-only table over the same stage map (`forward_only`)."""
    if prog.autodiff:
        return prog
    s = prog.schedule
    return Program(forward_only(s.n_stages, s.n_microbatches, s.n_chunks, s.placement),
                   prog.stage_layers)
