"""The cell kinds: one table, and the dependency rule between them.

A cell is one rank's work in one tick of a lockstep table, over one microbatch i and one
global stage g:

  F     the forward of microbatch i through stage g
  B     the gradient w.r.t. the stage's input (a split backward, Qi et al. 2024)
  W     the gradient w.r.t. its weights, from what B left in the stash
  BW    B and W fused, as in 1F1B
  BWj   a BW cut by layers into `parts` cells BW{parts-1}, ..., BW0: BWj is the fused
        backward of the j-th part of the stage's layers counted from the bottom, so the
        first to run is the top part and BW0 makes dx. With parts sized so that each
        costs what F costs (BW = 2F, or 3F under full remat) every lockstep tick costs
        one F: 1F1B's ticks are then balanced with synchronous sends.
  F+BW  no table holds it: with `parallel.combined_1f1b` the executor runs a BW and the
        F that follows it on the same rank (1F1B's steady state, F of microbatch i + 1
        beside BW of i) as one cell, their layer loops as one (`Program.fused`), so that
        the compiler can run one's collectives beside the other's matmuls.

Every fact about a kind is a field of its `CellKind` row in `KINDS` (indexed by `code`,
the small integer the tables hold): names, units of work and cost, what it waits for
(`waits`: the dependency rule), the tick of a pair it runs in, what its work makes
(`writes`), whether it ends the microbatch's time in flight or makes dx, its named scope
and its colour. The simulator, the buffer plan, the Program, the executor, the profiler
and the charts read the row. A new kind is a row here and its work in the executor
(`cells.Cells.work`).

The dependency rule, defined once (`needs`): what a unit of work waits for, and through
which buffer what it waits for reaches it (an ACT or GRAD message, or the microbatch's
STASH slot on its rank). When a message arrives is defined once too (`stored_at`): the
simulator schedules by both, the buffer plan derives messages and slots from them, and
its check replays them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

import numpy as np

ACT, GRAD, STASH = "act", "grad", "stash"  # how a cell gets what it needs
IDLE, F, B, W, BW = 0, 1, 2, 3, 4  # the codes of the kinds (BWj: 5 + j)
FBW = 8  # F and BW combined (`parallel.combined_1f1b`): the executor's, never a table's

Work = tuple[int, int, int]  # (kind, microbatch, global stage): one unit of work


@dataclass(frozen=True)
class Need:
    """A cell waits for `work` to have run; what that made reaches it through `via`:
    ACT or GRAD messages (the buffer plan's receive slots), or the STASH slot of the
    microbatch on this rank (what the forward kept for the backward)."""

    work: Work
    via: tuple[str, ...]


class Out(enum.Enum):
    """What a cell's work makes (`CellKind.writes`, in the order its branch returns it)."""

    KEPT = "kept"  # what its backward needs, for the microbatch's stash slot (F)
    DOUTS = "douts"  # the weight ops' output gradients W needs (B; stored after it)
    WEIGHT_GRADS = "weight_grads"  # gradients of the chunk's weights (its layers, BWj)
    ACT = ACT  # the activation message (F)
    GRAD = GRAD  # the gradient message: dL/dy, dx, or a part's gradient to the part below


@dataclass(frozen=True)
class CellKind:
    code: int  # in a table's arrays and the executor's scan inputs
    name: str  # what the charts, the profiler's timeline and the errors print
    action: str  # its type in torch.pipelining's CSV actions (`actions.py`)
    units: tuple  # the units of work it does (codes): a BW does a B and a W
    cost: int  # lockstep cost in F's (unit costs F = B = W, Qi et al. 2024)
    phase: Optional[int]  # overlapped sends: the tick of a pair it runs in (None: either)
    writes: tuple  # Out, ...: what its work makes
    waits: Optional[Callable]  # (kind, i, g, S, parts) -> [Need]; None: not one unit
    scope: Optional[str]  # the named scope of its branch in the tick executor
    colour: str  # in the charts (tools/schedule_plot.py)
    label: str  # in the charts' legend
    frees_stash: bool = False  # the microbatch's last cell on the stage: out of flight
    makes_dx: bool = False  # ends the stage's backward: dx down (first stage: embedding)
    head: bool = False  # on the last stage the head and the loss follow it (F)
    part: Optional[int] = None  # BWj: j


# --- What each kind waits for (`CellKind.waits`) ------------------------------------------

def _after_input(kind: int, i: int, g: int, S: int, parts: int) -> list[Need]:
    """F(i, g) needs F(i, g-1)'s output (the first stage: nothing)."""
    return [Need((F, i, g - 1), (ACT,))] if g > 0 else []


def _after_input_grad(kind: int, i: int, g: int, S: int, parts: int) -> list[Need]:
    """W(i, g) needs what B(i, g) left in the stash (the weight ops' output gradients,
    or under remat the incoming gradient)."""
    return [Need((B, i, g), (STASH,))]


def _after_output_grad(kind: int, i: int, g: int, S: int, parts: int) -> list[Need]:
    """The first backward cell of (i, g), B or the top part BW{parts-1}, needs F(i, g)'s
    stash and dL/dy: the last stage's own (its F computed the loss), else dx from the
    cell that makes dx for (i, g+1) (B, or BW0); a lower part BWj needs F's stash and
    the gradient BW{j+1} passed down (a message to itself)."""
    part = KINDS[kind].part
    if part is not None and part < parts - 1:
        return [Need((F, i, g), (STASH,)), Need((PARTS[part + 1].code, i, g), (GRAD,))]
    if g == S - 1:
        return [Need((F, i, g), (GRAD, STASH))]
    below = B if part is None else PARTS[0].code
    return [Need((F, i, g), (STASH,)), Need((below, i, g + 1), (GRAD,))]


# --- The table --------------------------------------------------------------------------

_BLUE, _ORANGE, _GREEN, _RED = "#4c78a8", "#f58518", "#54a24b", "#e45756"
_PART_COLOURS = (_RED, "#f28e8c", "#b33a3a")


def _part(j: int) -> CellKind:
    """BWj: part j of a BW cut by layers (bottom first); it costs one F."""
    return CellKind(5 + j, f"BW{j}", action="B", units=(5 + j,), cost=1, phase=1,
                    writes=(Out.WEIGHT_GRADS, Out.GRAD), waits=_after_output_grad,
                    scope=f"cell_backward_part{j}", colour=_PART_COLOURS[j],
                    label=f"backward, part {j} of the layers (BW{j})",
                    frees_stash=j == 0, makes_dx=j == 0, part=j)


KINDS: tuple[CellKind, ...] = (
    CellKind(IDLE, "idle", action="", units=(), cost=0, phase=None, writes=(), waits=None,
             scope=None, colour="white", label="idle"),
    CellKind(F, "F", action="F", units=(F,), cost=1, phase=0, writes=(Out.KEPT, Out.ACT),
             waits=_after_input, scope="cell_forward", colour=_BLUE, label="forward",
             head=True),
    CellKind(B, "B", action="I", units=(B,), cost=1, phase=1, writes=(Out.DOUTS, Out.GRAD),
             waits=_after_output_grad, scope="cell_input_grad", colour=_ORANGE,
             label="input gradient (B)", makes_dx=True),
    CellKind(W, "W", action="W", units=(W,), cost=1, phase=None, writes=(Out.WEIGHT_GRADS,),
             waits=_after_input_grad, scope="cell_weight_grad", colour=_GREEN,
             label="weight gradient (W)", frees_stash=True),
    CellKind(BW, "BW", action="B", units=(B, W), cost=2, phase=1,
             writes=(Out.WEIGHT_GRADS, Out.GRAD), waits=None, scope="cell_backward",
             colour=_RED, label="backward", frees_stash=True, makes_dx=True),
    *(_part(j) for j in range(3)),
    CellKind(FBW, "F+BW", action="", units=(F, B, W), cost=3, phase=None,
             writes=(Out.KEPT, Out.ACT, Out.WEIGHT_GRADS, Out.GRAD), waits=None,
             scope="cell_combined", colour="#9d755d",
             label="forward and backward combined (F+BW)", frees_stash=True, makes_dx=True,
             head=True),
)
PARTS = tuple(k for k in KINDS if k.part is not None)  # BW0, BW1, ...: a BW cut in parts
BW_PARTS = tuple(k.code for k in PARTS)
MAX_PARTS = len(PARTS)
BY_NAME = {k.name: k for k in KINDS}
assert all(k.code == n for n, k in enumerate(KINDS))

# Per code, for whole tables at once: cost, whether a cell stashes (F) / frees its slot.
COST = np.array([k.cost for k in KINDS])
STASHES = np.array([Out.KEPT in k.writes for k in KINDS])
FREES_STASH = np.array([k.frees_stash for k in KINDS])


def units(kind: int) -> tuple[int, ...]:
    """The units of work a cell does: BW is a B and a W at the same tick."""
    return KINDS[kind].units


def makes_dx(kind: int) -> bool:
    """The cell that ends a stage's backward, sending dx to the stage below (and, on the
    first stage, taking the embedding's gradient)."""
    return KINDS[kind].makes_dx


def backward_units(parts: int) -> tuple[int, ...]:
    """The units of work a table's backward cells do: its BW parts, or B and W (a BW
    does both)."""
    return tuple(k.code for k in PARTS[:parts]) if parts > 1 else (B, W)


# --- The dependency rule ----------------------------------------------------------------

def needs(kind: int, i: int, g: int, S: int, parts: int = 1) -> list[Need]:
    """The pipeline's dependency rule for one unit of work of microbatch i at global stage
    g of S, in a table whose BWs are cut into `parts`: the row's `waits`."""
    row = KINDS[kind]
    if row.waits is None or (row.part is not None and row.part >= parts):
        raise ValueError(f"needs: {row.name} is not one unit of work of a table with "
                         f"{parts} part(s) (see `units`)")
    return row.waits(kind, i, g, S, parts)


@lru_cache(maxsize=None)
def dependents(m: int, S: int) -> dict[Work, tuple[Work, ...]]:
    """The rule inverted: per unit of work of a table of F, B and W cells, the units
    that need it (m microbatches, S stages)."""
    out: dict[Work, list] = {}
    for kind in (F, B, W):
        for i in range(m):
            for g in range(S):
                for need in needs(kind, i, g, S):
                    out.setdefault(need.work, []).append((kind, i, g))
    return {k: tuple(v) for k, v in out.items()}


def stored_at(sent: int, src: int, dst: int, overlap: bool) -> int:
    """The tick at whose end a message made in tick `sent` on rank `src` is stored on
    rank `dst`, to be read from the next tick on: `sent` itself with synchronous sends
    or to itself; one later when sends overlap compute (it travels during that tick,
    `Schedule.overlap`). A cell's stash is its own rank's: as a message to itself."""
    return sent + int(overlap and src != dst)
