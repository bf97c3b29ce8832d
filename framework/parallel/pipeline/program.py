"""A schedule compiled once into everything its readers need: the `Program`.

    program("1f1b", p=2, m=4, v=1, overlap=False)
      .schedule        the table: (tick, rank) -> cell (`table.py`, made by `schedule.py`)
      .stages          the stage map: global stage <-> (rank, chunk)
      .buffers         the buffer plan: stash and receive slots per cell, the sends per
                       tick and channel, checked by replaying the table (`buffers.py`)
      .scan_inputs()   what the executor's tick loop scans over, one row per tick
      .kinds(phase)    the cell kinds a tick of the loop's step can run
      .branches(phase) the conditionals that tick's dispatch opens, in order: each
                       kind's work and what follows it, with their named scopes
      .scope_weights   per named scope those open, the share of the loop's executions
                       that run it (the communication audit weighs by it)
      .sends_per_step  messages put on the wire per step (the comm model, the planner)
      .fused           `parallel.combined_1f1b`: the BW and F cells run as one (F+BW)
      .real(stage)     uneven stages: how many of a chunk's layers are real
      .first(stage, n) the global index of a stage's first layer (sliding-window layers)

Both executors (`autodiff.py`, `ticks.py`), the memory and comm models, the audit, the
planner and the charts read a Program; nothing else derives any of these. Programs are
cached: one per (schedule, pipeline, microbatches, virtual stages, sends, stage layers).
The buffer plan is built when first read (at p 16, m 128 it takes a while, and the
planner only needs the table and the send count).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from framework.parallel.pipeline import buffers as buffer_plan
from framework.parallel.pipeline.layout import stage_starts
from framework.parallel.pipeline.schedule import forward_only, make_schedule
from framework.parallel.pipeline.kinds import BW, FBW, IDLE, KINDS, B, CellKind, F, Out
from framework.parallel.pipeline.scopes import ON_FIRST, ON_LAST, STAGE, send_scope
from framework.parallel.pipeline.table import AUTODIFF, Schedule, StageMap


class Role(enum.Enum):
    """What a branch of a tick's dispatch does for its kind (`Branch`)."""

    WORK = "the kind's work (`cells.Cells.work`)"
    HEAD = "after F on the last stage: the head and the loss"
    EMBED_GRAD = "after the cell that makes dx, on the first stage: the embedding's gradient"
    STORE_DOUTS = "after B: its douts into the microbatch's slot (synchronous sends)"
    HELD_DOUTS = "first in a pair's forward tick: the last tick's B douts into their slot"


class Branch(NamedTuple):
    """One conditional of a tick's dispatch: `role` for the ranks whose cell is of `kind`
    (and, `on` "first" / "last", whose stage is the first / last), inside `scopes`
    (outermost first)."""

    kind: CellKind
    role: Role
    on: Optional[str]
    scopes: tuple


@dataclass(frozen=True, eq=False)
class Program:
    schedule: Schedule
    stage_layers: Optional[tuple] = None  # real layers per global stage (None: even)
    combined: bool = False  # parallel.combined_1f1b: a BW and the F after it as one cell

    @property
    def stages(self) -> StageMap:
        return self.schedule.stages

    @property
    def autodiff(self) -> bool:
        """GPipe and circular: the executor runs the forward rows, autodiff the rest."""
        return self.schedule.executor == AUTODIFF

    @cached_property
    def buffers(self) -> buffer_plan.Buffers:
        return buffer_plan.plan(self.schedule, self.combined)

    @cached_property
    def sends_per_step(self) -> int:
        return buffer_plan.sends_per_step(self.schedule, self.combined)

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

    @cached_property
    def fused(self) -> np.ndarray:
        """[ticks, ranks] the cells that run combined (`parallel.combined_1f1b`): a BW in
        a pair's backward tick and the F in the next pair's forward tick on the same
        rank, as one F+BW cell (Megatron-LM's combined 1F1B: F of microbatch i + 1 beside
        BW of i). Neither waits for the other: the F's input arrived during the BW's
        tick, and the BW's dL/dy before it. All False unless `combined`."""
        k = self.schedule.kind
        out = np.zeros(k.shape, bool)
        if self.combined:
            pair = (k[1:-1:2] == BW) & (k[2::2] == F)  # ticks (2s+1, 2s+2)
            out[1:-1:2] |= pair
            out[2::2] |= pair
        return out

    @property
    def fused_share(self) -> float:
        """The share of the forwards that run combined (`fused`; 0 unless `combined`)."""
        forwards = self.schedule.kind == F
        return float((self.fused & forwards).sum() / max(1, forwards.sum()))

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
        if self.combined:
            rows["fused"] = self.fused
        return rows

    def branches(self, phase: int) -> tuple[Branch, ...]:
        """The conditionals tick `phase` of the tick loop's step opens, in order: with
        a pair of ticks a step and a split backward, first the last tick's B douts
        (`Role.HELD_DOUTS`); then per kind it runs (`kinds`), its work, and what follows
        it on its row's say: the head after F (`CellKind.head`), B's douts after B
        (one tick a step), the embedding's gradient after dx (`CellKind.makes_dx`)."""
        s, out = self.schedule, []
        pair = s.ticks_per_step > 1
        if phase == 0 and pair and s.split_backward:
            out.append(Branch(KINDS[B], Role.HELD_DOUTS, None, (KINDS[B].scope,)))
        for kind in (KINDS[k] for k in sorted(self.kinds(phase))):
            out.append(Branch(kind, Role.WORK, None, (kind.scope,)))
            if kind.head:
                out.append(Branch(kind, Role.HEAD, "last", (kind.scope, ON_LAST)))
            if Out.DOUTS in kind.writes and not pair:
                out.append(Branch(kind, Role.STORE_DOUTS, None, (kind.scope,)))
            if kind.makes_dx:
                out.append(Branch(kind, Role.EMBED_GRAD, "first", (kind.scope, ON_FIRST)))
        return tuple(out)

    def combined_branches(self) -> tuple[Branch, ...]:
        """The conditionals of a combined cell (`fused`), in the order they run: the
        F+BW work, the embedding's gradient after its dx (first stage), the head after
        its F (last stage)."""
        kind = KINDS[FBW]
        return (Branch(kind, Role.WORK, None, (kind.scope,)),
                Branch(kind, Role.EMBED_GRAD, "first", (kind.scope, ON_FIRST)),
                Branch(kind, Role.HEAD, "last", (kind.scope, ON_LAST)))

    def _counted(self, code: int) -> np.ndarray:
        """[ticks, ranks] the cells a branch of kind `code` runs for: its kind's cells
        that do not run combined; F+BW: one per combined pair, at its F."""
        s = self.schedule
        if code == FBW:
            return self.fused & (s.kind == F)
        return (s.kind == code) & ~self.fused

    def _branch_weight(self, branch: Branch, steps: int) -> float:
        """The share of its conditional's executions on a device that run `branch`: a
        kind's cells over the ticks whose dispatch holds its branch (each tick of the
        step its kind runs in); nested in the kind's scope, its cells on the stage `on`
        over all of them (the head on the last stage's m F cells, ...)."""
        s, code = self.schedule, branch.kind.code
        counted = self._counted(code)
        cells = int(counted.sum())
        if branch.on is None:
            if code == FBW:  # in the loop only: its first and last ticks run apart
                return cells / max(1, (steps - 1) * s.n_stages)
            ticks = sum(any(b.role is Role.WORK and b.kind == branch.kind for b in
                            self.branches(phase)) for phase in range(s.ticks_per_step))
            return float(cells) / (steps * s.n_stages * max(1, ticks))
        stage = 0 if branch.on == "first" else s.n_global_stages - 1
        if code == FBW and branch.on == "first":  # the embedding's gradient follows BW
            counted = np.roll(counted, -1, axis=0) & (s.kind == BW)
        return int((counted & (s.global_stage == stage)).sum()) / max(cells, 1)

    @cached_property
    def scope_weights(self) -> dict[str, float]:
        """Per named scope the executor's program opens, the share of the loop body's
        executions on a device that run it. Tick executor: the innermost scope of each
        branch its dispatch opens (`branches`). Autodiff executor: a rank is busy in its
        share of the forward rows' cells."""
        s, p = self.schedule, self.schedule.n_stages
        if self.autodiff:
            weights = {ON_FIRST: 1 / p, ON_LAST: 1 / p,
                       STAGE: float((s.forward_rows().kind == F).mean())}
        else:
            steps = s.n_ticks // s.ticks_per_step
            branches = [b for phase in range(s.ticks_per_step) for b in self.branches(phase)]
            if self.combined:
                branches += self.combined_branches()
            weights = {b.scopes[-1]: self._branch_weight(b, steps) for b in branches}
        # Sends: per pattern, the share of ticks that send it (overlapped: every tick of
        # the loop's step it is in, unconditionally).
        weights.update({send_scope(ch, k): 1.0 if ch.overlap else float(np.mean(ch.pattern == k))
                        for ch in self.buffers.channels for k in range(1, len(ch.pairs))})
        return weights


@lru_cache(maxsize=None)
def program(name: str, pipeline: int, microbatches: int, virtual_stages: int = 1,
            overlap: bool = True, stage_layers: Optional[tuple] = None,
            parts: int = 1, combined: bool = False) -> Program:
    """The Program of `parallel.schedule` (raises ValueError for a bad combination: see
    `schedule.check`). `overlap`: `parallel.overlap_sends`; `stage_layers`: counts per
    global stage (resolved, not `auto`) or None; `parts`: the cells a BW is cut into
    where the schedule does that; `combined`: `parallel.combined_1f1b` (a configuration's
    Program, with these resolved from its settings: `framework/engine/resolved.py`,
    `Layout.program`)."""
    schedule = make_schedule(name, pipeline, microbatches, virtual_stages, overlap, parts)
    layers = tuple(int(n) for n in stage_layers) if stage_layers is not None else None
    if combined and (schedule.executor == AUTODIFF or schedule.split_backward
                     or not overlap or not (schedule.kind == BW).any()):
        raise ValueError(f"parallel.combined_1f1b needs a tick schedule with whole BW cells "
                         f"and overlapped sends (1f1b, interleaved_1f1b with "
                         f"parallel.overlap_sends true), not {name}"
                         f"{'' if overlap else ' with synchronous sends'}")
    return Program(schedule, layers, combined)


@lru_cache(maxsize=None)
def forward_program(prog: Program) -> Program:
    """What evaluation runs for `prog`'s layout: its own forward rows (autodiff
    schedules), or the forward-only table over the same stage map (`forward_only`)."""
    if prog.autodiff:
        return prog
    s = prog.schedule
    return Program(forward_only(s.n_stages, s.n_microbatches, s.n_chunks, s.placement),
                   prog.stage_layers)
