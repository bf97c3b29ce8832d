"""What a pipeline table is made of: its cells, the stage map, the table.

A table is (tick, rank) -> cell, a cell one kind of work (`kinds.py`: F, B, W, BW, the
BW parts, each one row of `KINDS`) over one microbatch and one layer chunk of the rank.
Kinds are small integers, one encoding for everyone: the table's arrays, the
simulator's records, the buffer plan and the charts.

Two facts every reader of a table needs besides the kinds (and their dependency rule,
`kinds.needs`), each defined once here:

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

from framework.parallel.pipeline.kinds import (COST, FREES_STASH, KINDS, STASHES, B, F, W,
                                               Work, units)

AUTODIFF, TICKS = "autodiff", "ticks"  # who runs the backward: JAX autodiff, or the table
INTERLEAVED, V_SHAPE = "interleaved", "v"  # where global stages live (`StageMap`)


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
    kind: np.ndarray  # [ticks, ranks] the cells' kinds (`kinds.KINDS` codes)
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
        cost = COST[self.kind]
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
        live = np.cumsum(STASHES[self.kind].astype(int) - FREES_STASH[self.kind], axis=0)
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
                    raise ValueError(f"schedule {self.name}: {KINDS[k].name}({work[1]}, "
                                     f"stage {work[2]}) appears twice")
                at[work] = (t, r)
        return at
