"""What a pipeline table is made of: cells, the dependency rule, the stage map.

A cell is F(i, g) (forward of microbatch i through global stage g), B(i, g) (the
gradient w.r.t. the stage's input), W(i, g) (the gradient w.r.t. its weights) or
BW(i, g) (B and W fused, as in 1F1B). A table may also cut each BW into `parts` cells
by layers, BW{k-1}(i, g), ..., BW0(i, g): BWj is the fused backward of the j-th part of
the stage's layers counted from the bottom, so the first to run is the top part and
BW0 makes dx. With parts sized so that each costs what F costs (BW = 2F, or 3F under
full remat), every lockstep tick costs one F: 1F1B's ticks are then balanced with
synchronous sends, at 1F1B's closed-form bubble and its p microbatches in flight.
Kinds are small integers, one encoding for everyone: the table's arrays, the
simulator's records, the buffer plan and the charts (`KIND_NAMES` only for printing).
A BW cell does the work of a B and a W (`units`).

Three facts every reader of a table needs, each defined once here:

  the dependency rule  `needs(kind, i, g, S)`: what a cell waits for, and through which
                       buffer what it waits for reaches it (an activation message, a
                       gradient message, or the microbatch's stash slot). The simulator
                       schedules by it, the buffer plan derives messages and slots from
                       it, and the plan's check replays it. `dependents` is its inverse.
  the stage map        `StageMap`: global stage g <-> (rank, chunk). Megatron-LM's
                       interleaved assignment (Narayanan et al. 2021): stage c*p + r on
                       rank r as its chunk c, so a microbatch goes round the ring v
                       times; or ZB-V's V (Qi et al. 2024): rank r holds stages r and
                       2p-1-r. The parameter layout, the comm model and the tables read it.
  the table            `Schedule`: (tick, rank) -> cell, the single source every other
                       object of the pipeline is derived from (`program.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

IDLE, F, B, W, BW = 0, 1, 2, 3, 4
BW_PARTS = (5, 6, 7)  # BW0, BW1, BW2: a BW cut by layers, counted from the bottom
MAX_PARTS = len(BW_PARTS)
KIND_NAMES = ("idle", "F", "B", "W", "BW", "BW0", "BW1", "BW2")
# Unit costs (Qi et al. 2024's analysis: F = B = W); a fused BW costs B + W; a part of
# a BW cut into as many parts as it costs F's, one F.
UNIT_COST = np.array([0, 1, 1, 1, 2, 1, 1, 1])
AUTODIFF, TICKS = "autodiff", "ticks"  # who runs the backward: JAX autodiff, or the table
INTERLEAVED, V_SHAPE = "interleaved", "v"  # where global stages live (`StageMap`)
ACT, GRAD, STASH = "act", "grad", "stash"  # how a cell gets what it needs


def units(kind: int) -> tuple[int, ...]:
    """The units of work a cell does: BW is a B and a W at the same tick."""
    return (B, W) if kind == BW else () if kind == IDLE else (kind,)


MAKES_DX = (B, BW, BW_PARTS[0])  # the kinds that end a stage's backward (`makes_dx`)


def makes_dx(kind: int) -> bool:
    """The cell that ends a stage's backward, sending dx to the stage below (and, on the
    first stage, taking the embedding's gradient)."""
    return kind in MAKES_DX


# --- The dependency rule ----------------------------------------------------------------

Work = tuple[int, int, int]  # (kind, microbatch, global stage): one unit of work


@dataclass(frozen=True)
class Need:
    """A cell waits for `work` to have run; what that made reaches it through `via`:
    ACT or GRAD messages (the buffer plan's receive slots), or the STASH slot of the
    microbatch on this rank (what the forward kept for the backward)."""

    work: Work
    via: tuple[str, ...]


def needs(kind: int, i: int, g: int, S: int, parts: int = 1) -> list[Need]:
    """The pipeline's dependency rule, for one unit of work of microbatch i at global
    stage g of S (in a table whose BWs are cut into `parts`): F(i, g) needs F(i, g-1)'s
    output; the first backward cell of (i, g), B or the top part BW{parts-1}, needs
    F(i, g)'s stash and dL/dy: the last stage's own (its F computed the loss), else dx
    from the cell that ends the backward of (i, g+1) (B, or BW0); a lower part BWj
    needs F's stash and the gradient BW{j+1} passed down (a message to itself); W(i, g)
    needs what B(i, g) left in the stash (the weight ops' output gradients, or under
    remat the incoming gradient)."""
    if kind == F:
        return [Need((F, i, g - 1), (ACT,))] if g > 0 else []
    if kind == W:
        return [Need((B, i, g), (STASH,))]
    if kind == B or kind in BW_PARTS[:parts]:
        top = kind == B or kind == BW_PARTS[parts - 1]
        if not top:  # a lower part: the gradient from the part above it
            return [Need((F, i, g), (STASH,)), Need((kind + 1, i, g), (GRAD,))]
        if g == S - 1:
            return [Need((F, i, g), (GRAD, STASH))]
        below = B if kind == B else BW_PARTS[0]
        return [Need((F, i, g), (STASH,)), Need((below, i, g + 1), (GRAD,))]
    raise ValueError(f"needs: {KIND_NAMES[kind]} is not one unit of work of a table with "
                     f"{parts} part(s) (see `units`)")


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


# --- The stage map ----------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class StageMap:
    """Global stage <-> (rank, chunk): `of[rank, chunk]` is the global stage,
    `rank[g]`, `chunk[g]` where stage g lives."""

    placement: str
    of: np.ndarray  # [ranks, chunks] -> global stage

    @cached_property
    def rank(self) -> np.ndarray:  # [S]
        return np.argsort(self.of.ravel()) // self.of.shape[1]

    @cached_property
    def chunk(self) -> np.ndarray:  # [S]
        return np.argsort(self.of.ravel()) % self.of.shape[1]

    @property
    def n_stages(self) -> int:
        return self.of.size

    def crossings(self) -> int:
        """Stage boundaries g -> g+1 whose two stages are on different ranks: p*v - 1
        interleaved, 2p - 2 in a V (the turn stays on the last rank)."""
        return int((self.rank[1:] != self.rank[:-1]).sum())


@lru_cache(maxsize=None)
def stage_map(placement: str, p: int, v: int) -> StageMap:
    """INTERLEAVED (Megatron-LM): stage c*p + r on rank r as its chunk c. V_SHAPE (v = 2,
    ZB-V): rank r holds stages r and 2p-1-r, so a microbatch goes down the ranks and
    back up, and rank 0 holds both the first and the last stage."""
    if placement == V_SHAPE:
        of = np.stack([np.arange(p), 2 * p - 1 - np.arange(p)], axis=1)
    else:
        of = np.arange(v)[None, :] * p + np.arange(p)[:, None]
    return StageMap(placement, of)


# --- The table ----------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Schedule:
    name: str
    n_stages: int  # pipeline ranks, p
    n_microbatches: int  # m
    n_chunks: int  # layer chunks per rank, v
    kind: np.ndarray  # [ticks, ranks] IDLE / F / B / W / BW
    microbatch: np.ndarray  # [ticks, ranks] (0 where idle)
    chunk: np.ndarray  # [ticks, ranks] chunk index on that rank (0 where idle)
    formula_bubble: float  # the closed form from the paper the schedule comes from
    executor: str = TICKS  # AUTODIFF: the executor runs the F rows, autodiff the rest
    placement: str = INTERLEAVED  # or V_SHAPE (`stage_map`)
    overlap: bool = False  # sends overlap the next tick (ticks in forward/backward pairs)
    parts: int = 1  # BWs cut into this many cells by layers (BW0..); 1: whole BWs

    @property
    def n_ticks(self) -> int:
        return self.kind.shape[0]

    @property
    def n_global_stages(self) -> int:
        return self.n_stages * self.n_chunks

    @property
    def stages(self) -> StageMap:
        return stage_map(self.placement, self.n_stages, self.n_chunks)

    @property
    def global_stage(self) -> np.ndarray:
        """[ticks, ranks] the global stage of every cell (meaningless where idle)."""
        return self.stages.of[np.arange(self.n_stages)[None, :], self.chunk]

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into B and W cells (zero-bubble schedules)."""
        return bool(np.isin(self.kind, (B, W)).any())

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step in lockstep ticks with unit costs (F = B = W = 1, BW =
        2): every rank waits for the slowest cell of each tick, as one SPMD program
        does. 1 - busy cost / (ranks x sum over ticks of the tick's largest cost)."""
        cost = UNIT_COST[self.kind]
        return float(1 - cost.sum() / (self.n_stages * cost.max(axis=1).sum()))

    def forward_rows(self) -> "Schedule":
        """The rows the executor runs itself: the forward half for autodiff schedules."""
        if self.executor != AUTODIFF:
            return self
        t = int((self.kind == F).any(axis=1).nonzero()[0].max()) + 1
        return Schedule(self.name, self.n_stages, self.n_microbatches, self.n_chunks,
                        self.kind[:t], self.microbatch[:t], self.chunk[:t],
                        self.formula_bubble, self.executor, self.placement)

    @property
    def ticks_per_step(self) -> int:
        """Ticks per step of the tick executor's loop: a (forward, backward) pair when
        sends overlap, so that each channel sends only in the tick of the pair its
        messages travel in; one tick otherwise."""
        return 2 if self.overlap else 1

    def max_in_flight(self) -> np.ndarray:
        """Per rank: the most microbatch-chunks whose forward ran but whose weight
        gradient (BW or W) did not yet."""
        done = np.isin(self.kind, (BW, W, BW_PARTS[0]))
        live = np.cumsum((self.kind == F).astype(int) - done, axis=0)
        return live.max(axis=0)

    def cells(self) -> dict[Work, tuple[int, int]]:
        """Unit of work (kind, microbatch, global stage) -> (tick, rank) of the cell that
        does it (a BW cell does a B and a W). Raises if one is done twice."""
        at = {}
        stage = self.global_stage
        for (t, r), kind in np.ndenumerate(self.kind):
            for k in units(int(kind)):
                work = (k, int(self.microbatch[t, r]), int(stage[t, r]))
                if work in at:
                    raise ValueError(f"schedule {self.name}: {KIND_NAMES[k]}({work[1]}, "
                                     f"stage {work[2]}) appears twice")
                at[work] = (t, r)
        return at
