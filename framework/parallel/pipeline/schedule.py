"""Pipeline schedules as tables: (tick, rank) -> one cell of work, or idle.

A cell is F(i, c) (forward of microbatch i through this rank's layer chunk c), B(i, c)
(the gradient w.r.t. the chunk's input), W(i, c) (the gradient w.r.t. its weights) or
BW(i, c) (B and W fused, as in 1F1B). The table is the single source of truth: the
executors run it, `framework/parallel/pipeline/buffers.py` derives the stash and receive slots
and the point-to-point sends from it, and the bubble, the audit's weights, the memory
model and `tools/schedule_plot.py` read it.

Global stages. With p ranks and v chunks per rank the model is cut into S = p*v stages;
`stage_of[rank, chunk]` says which one a (rank, chunk) holds. Megatron-LM's interleaved
assignment (Narayanan et al. 2021), used by every schedule here: stage g lives on rank
g mod p as its chunk g // p, so a microbatch goes round the ring v times.

Schedules (register a new one with `@register`; nothing else needs to change):

  gpipe             (Huang et al. 2019) all forwards, then all backwards. The executor
                    runs the forward rows; JAX autodiff runs the mirrored backward half.
                    Bubble (p-1)/(m+p-1).
  circular          (MaxText's circular pipeline) GPipe with v chunks per rank:
                    forward of microbatch i, chunk c on rank r at tick c*m + i + r
                    (needs m >= p). Bubble (p-1)/(v*m+p-1). Autodiff backward.
  1f1b              (PipeDream-Flush, Narayanan et al. 2021) rank r runs p-1-r warm-up
                    forwards, then alternates F and BW, then drains. (p-1)/(m+p-1).
  interleaved_1f1b  (Megatron-LM's interleaved schedule, Narayanan et al. 2021) 1F1B
                    over v chunks per rank, microbatches in groups of p (m % p == 0).
                    Bubble (p-1)/(v*m+p-1): v times shorter idle ticks.
  zb_h1             (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ZB-H1) 1F1B with
                    the backward split into B and W; rank r postpones its first r W's
                    so every rank keeps p microbatches in flight (1F1B's peak, reached on
                    rank 0) and the postponed W's fill the drain. With unit-cost F, B, W:
                    bubble (p-1)/(3m+p-1), a third of 1F1B's idle time.

All tick-loop schedules come from one simulator (`simulate`): each rank runs its program
(an ordered list of cells) in lockstep ticks, a cell starting at the first tick after
everything it depends on has finished.

Sends that overlap compute (`overlap`, `parallel.overlap_sends`, the default). A
synchronous send sits between two ticks: a message sent at tick t is usable at t+1, and
no compute runs while it travels. An overlapped send travels during the sender's next
tick (`framework/parallel/pipeline/ticks.py`), so a message to another rank is usable at
t+2 (to itself still at t+1). Ticks then come in pairs, a forward tick (F, or W) and a
backward tick (B or BW, or W): the activations travel during the backward tick and the
gradients during the next forward tick, and each hop costs one pair. 1F1B then runs
one F and one BW in every pair of its steady state on every rank: its lockstep ticks are
balanced (F + BW each), so its table bubble is the closed form (synchronous: 40.0%
against 27.3% at p 4, m 8, as a rank's F tick is its neighbour's BW tick). What it
costs: a microbatch's round trip from rank r to the last rank and back takes 2(p-1-r)
pairs instead of ticks, so rank r keeps 2(p-1-r)+1 microbatches in flight (Megatron-LM's
warm-up with overlapped sends) instead of p-r: up to 2p-1 stashes instead of p.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np

IDLE, F, B, W, BW = 0, 1, 2, 3, 4
KIND_NAMES = ("idle", "F", "B", "W", "BW")
# Unit costs (Qi et al. 2024's analysis: F = B = W); a fused BW costs B + W.
UNIT_COST = np.array([0, 1, 1, 1, 2])
AUTODIFF, TICKS = "autodiff", "ticks"  # who runs the backward: JAX autodiff, or the table
INTERLEAVED, V_SHAPE = "interleaved", "v"  # where global stages live (see Schedule)


def stage_map(placement: str, p: int, v: int) -> np.ndarray:
    """[ranks, chunks] -> global stage. INTERLEAVED (Megatron-LM): stage c*p + r on rank
    r as its chunk c. V_SHAPE (v = 2, Qi et al. 2024's ZB-V): rank r holds stages r and
    2p-1-r, so a microbatch goes down the ranks and back up, and rank 0 holds both the
    first and the last stage."""
    if placement == V_SHAPE:
        return np.stack([np.arange(p), 2 * p - 1 - np.arange(p)], axis=1)
    return np.arange(v)[None, :] * p + np.arange(p)[:, None]


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

    @property
    def n_ticks(self) -> int:
        return self.kind.shape[0]

    @property
    def n_global_stages(self) -> int:
        return self.n_stages * self.n_chunks

    @cached_property
    def stage_of(self) -> np.ndarray:
        """[ranks, chunks] -> global stage (`stage_map`)."""
        return stage_map(self.placement, self.n_stages, self.n_chunks)

    @cached_property
    def rank_chunk_of(self) -> dict[int, tuple[int, int]]:
        """Global stage -> (rank, chunk)."""
        return {int(g): (r, c) for (r, c), g in np.ndenumerate(self.stage_of)}

    @property
    def global_stage(self) -> np.ndarray:
        """[ticks, ranks] the global stage of every cell (meaningless where idle)."""
        return self.stage_of[np.arange(self.n_stages)[None, :], self.chunk]

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
        done = (self.kind == BW) | (self.kind == W)
        live = np.cumsum((self.kind == F).astype(int) - done, axis=0)
        return live.max(axis=0)


# --- Generators: name -> (p, m, v) -> Schedule ---------------------------------------

@dataclass(frozen=True)
class Generator:
    build: Callable[..., Schedule]  # (p, m, v, overlap) -> Schedule
    uses_virtual_stages: bool  # reads parallel.virtual_stages (else it must be 1)
    check: Callable[[int, int, int], list[str]]  # (p, m, v) -> one-line problems
    chunks: int = 0  # a fixed number of chunks per rank (0: virtual_stages, or 1)
    placement: str = INTERLEAVED


GENERATORS: dict[str, Generator] = {}


def register(name: str, uses_virtual_stages: bool = False,
             check: Callable[[int, int, int], list[str]] = lambda p, m, v: [],
             chunks: int = 0, placement: str = INTERLEAVED):
    """Decorator: `build(p, m, v, overlap) -> Schedule` becomes `parallel.schedule=<name>`
    (`overlap`: `parallel.overlap_sends`, for `simulate`; a table with the default
    overlap=False runs with synchronous sends)."""
    def wrap(build):
        GENERATORS[name] = Generator(build, uses_virtual_stages, check, chunks, placement)
        return build
    return wrap


def schedule_names() -> tuple[str, ...]:
    return tuple(GENERATORS)


def check(name: str, p: int, m: int, v: int) -> list[str]:
    """One-line problems with (parallel.schedule, pipeline, microbatches, virtual_stages)."""
    if name not in GENERATORS:
        return [f"parallel.schedule={name!r} is not one of {', '.join(GENERATORS)}"]
    gen = GENERATORS[name]
    if not gen.uses_virtual_stages and v != 1:
        users = [n for n, g in GENERATORS.items() if g.uses_virtual_stages]
        return [f"parallel.virtual_stages={v} only applies to parallel.schedule in "
                f"{{{', '.join(users)}}}: set it to 1 or pick one of those"]
    return gen.check(p, m, v)


def uses_virtual_stages(name: str) -> bool:
    return name in GENERATORS and GENERATORS[name].uses_virtual_stages


def chunks_per_rank(name: str, virtual_stages: int) -> int:
    if name in GENERATORS and GENERATORS[name].chunks:
        return GENERATORS[name].chunks
    return virtual_stages if uses_virtual_stages(name) else 1


def v_shaped(name: str) -> bool:
    """The schedule places its stages in a V (`stage_map`): the parameter layout follows."""
    return name in GENERATORS and GENERATORS[name].placement == V_SHAPE


def make_schedule(name: str, pipeline: int, microbatches: int, virtual_stages: int = 1,
                  overlap: bool = True) -> Schedule:
    """The table of `parallel.schedule`; `overlap`: `parallel.overlap_sends` (tick
    schedules; GPipe and circular send synchronously either way)."""
    problems = check(name, pipeline, microbatches, virtual_stages)
    if problems:
        raise ValueError("; ".join(problems))
    return _build(name, pipeline, microbatches, chunks_per_rank(name, virtual_stages),
                  bool(overlap))


_CACHE: dict = {}


def _build(name, p, m, v, overlap) -> Schedule:
    if (name, p, m, v, overlap) not in _CACHE:
        _CACHE[name, p, m, v, overlap] = GENERATORS[name].build(p, m, v, overlap=overlap)
    return _CACHE[name, p, m, v, overlap]


# --- The lockstep simulator behind every tick-loop schedule --------------------------

Cell = tuple[int, int, int]  # (kind, microbatch, chunk)


def _needs(kind: int, i: int, g: int, S: int) -> list[tuple[str, int, int]]:
    """What cell (kind, microbatch i, global stage g) waits for: F(i, g) for F(i, g-1);
    B or BW(i, g) for F(i, g) and the backward of (i, g+1); W(i, g) for B(i, g)."""
    if kind == F:
        return [("F", i, g - 1)] if g > 0 else []
    if kind in (B, BW):
        return [("F", i, g)] + ([("B", i, g + 1)] if g < S - 1 else [])
    return [("B", i, g)]


@dataclass(frozen=True)
class Clock:
    """When a cell may run in a lockstep table: after what it needs, one tick after
    a message to itself, two after one from another rank when sends overlap (then F
    runs only in forward ticks, even, and B or BW only in backward ticks, odd)."""

    stages: np.ndarray  # [ranks, chunks] -> global stage
    overlap: bool

    @cached_property
    def owner(self) -> dict[int, int]:
        return {int(g): r for (r, _), g in np.ndenumerate(self.stages)}

    def ready(self, cell: Cell, r: int, t: int, done: dict) -> bool:
        kind, i, c = cell
        if self.overlap and kind != W and (kind == F) != (t % 2 == 0):
            return False
        for need in _needs(kind, i, int(self.stages[r, c]), self.stages.size):
            lag = 2 if self.overlap and self.owner[need[2]] != r else 1
            if done.get(need, t) + lag > t:
                return False
        return True

    def letter(self, cell: Cell, r: int) -> tuple[str, int, int]:
        """The key `done` records a finished cell under (BW counts as B)."""
        kind, i, c = cell
        return ("F" if kind == F else "B" if kind in (B, BW) else "W", i,
                int(self.stages[r, c]))


def simulate(name: str, p: int, m: int, v: int, programs: list[list[Cell]],
             formula: float, placement: str = INTERLEAVED, overlap: bool = False) -> Schedule:
    """Runs each rank's program in lockstep ticks, each cell at the first tick its
    `Clock` allows. Raises if the programs deadlock."""
    clock = Clock(stage_map(placement, p, v), overlap)
    done: dict[tuple[str, int, int], int] = {}
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
                done[clock.letter(cell, r)] = t
                pc[r] += 1
        rows.append(row)
    return _table(name, p, m, v, rows, formula, placement, overlap)


def _table(name, p, m, v, rows, formula, placement, overlap) -> Schedule:
    if overlap and len(rows) % 2:  # whole (forward, backward) pairs
        rows.append([None] * p)
    grid = np.array([[cell or (IDLE, 0, 0) for cell in row] for row in rows], np.int32)
    return Schedule(name, p, m, v, grid[..., 0], grid[..., 1], grid[..., 2], formula,
                    placement=placement, overlap=overlap)


# --- The schedules -------------------------------------------------------------------

def _mirrored(name, p, m, v, kind, micro, chunk, formula) -> Schedule:
    """Appends the backward half that autodiff runs: forward tick t mirrored to tick
    2T-1-t, same rank, same microbatch and chunk, as fused BW cells."""
    back = np.where(kind == F, BW, IDLE)[::-1]
    return Schedule(name, p, m, v, np.concatenate([kind, back]),
                    np.concatenate([micro, micro[::-1]]),
                    np.concatenate([chunk, chunk[::-1]]), formula, AUTODIFF)


def _circular_check(p, m, v):
    if v > 1 and m < p:
        return [f"parallel.microbatches={m} < parallel.pipeline={p}: the circular schedule "
                f"needs microbatches >= pipeline (a microbatch must leave the last rank "
                f"before the first rank needs it again)"]
    return []


def circular(p: int, m: int, v: int, overlap: bool = False) -> Schedule:
    """Circular schedule with v chunks per rank; v = 1 is GPipe. Autodiff runs the
    backward, and the sends stay synchronous (`overlap` does not apply)."""
    ticks = v * m + p - 1
    k = np.arange(ticks)[:, None] - np.arange(p)[None, :]  # [ticks, ranks]
    valid = (k >= 0) & (k < v * m)
    k = np.where(valid, k, 0)
    return _mirrored("gpipe" if v == 1 else "circular", p, m, v,
                     np.where(valid, F, IDLE).astype(np.int32), (k % m).astype(np.int32),
                     (k // m).astype(np.int32), (p - 1) / (v * m + p - 1))


@register("gpipe")
def gpipe(p: int, m: int, v: int = 1, overlap: bool = False) -> Schedule:
    return circular(p, m, 1)


register("circular", uses_virtual_stages=True, check=_circular_check)(circular)


def _one_f_one_b_programs(p: int, m: int, v: int, overlap: bool) -> list[list[Cell]]:
    """Megatron-LM's (interleaved) 1F1B order. Virtual microbatch k of a rank is
    microbatch (k // (p*v)) * p + k % p of chunk (k // p) % v (forward; the backward
    visits the chunks in reverse). Rank r warms up with (p-1-r) + (v-1)*p forwards,
    then alternates F and BW; with overlapped sends with 2(p-1-r) + (v-1)*p, Megatron-
    LM's warm-up when its sends overlap compute: a round trip to the last rank then
    takes 2(p-1-r) tick pairs, each with one F and one BW."""
    def cell(kind, k):
        group = k % (p * v)
        chunk = group // p if kind == F else v - 1 - group // p
        return (kind, (k // (p * v)) * p + k % p, chunk)

    programs = []
    for r in range(p):
        n = m * v
        warm = min((p - 1 - r) * (2 if overlap else 1) + (v - 1) * p, n)
        prog = [cell(F, k) for k in range(warm)]
        for k in range(n - warm):
            prog += [cell(F, warm + k), cell(BW, k)]
        prog += [cell(BW, k) for k in range(n - warm, n)]
        programs.append(prog)
    return programs


@register("1f1b")
def one_f_one_b(p: int, m: int, v: int = 1, overlap: bool = False) -> Schedule:
    return simulate("1f1b", p, m, 1, _one_f_one_b_programs(p, m, 1, overlap),
                    (p - 1) / (m + p - 1), overlap=overlap)


def _interleaved_check(p, m, v):
    if m % p:
        return [f"parallel.microbatches={m} is not a multiple of parallel.pipeline={p}: "
                f"the interleaved 1F1B schedule runs microbatches in groups of pipeline "
                f"(use {max(p, m // p * p)} or {(m // p + 1) * p})"]
    return []


@register("interleaved_1f1b", uses_virtual_stages=True, check=_interleaved_check)
def interleaved_1f1b(p: int, m: int, v: int, overlap: bool = False) -> Schedule:
    return simulate("interleaved_1f1b", p, m, v, _one_f_one_b_programs(p, m, v, overlap),
                    (p - 1) / (v * m + p - 1), overlap=overlap)


@register("zb_h1")
def zb_h1(p: int, m: int, v: int = 1, overlap: bool = False) -> Schedule:
    """ZB-H1 (Qi et al. 2024, section 2.1). Rank r: 1F1B's p-1-r warm-up forwards, then
    F, B and W in turn, except that its first r rounds skip the W (run at the very end):
    every rank then holds p microbatches between F and W, the peak 1F1B has on rank 0,
    and the postponed W's fill the drain's idle ticks. With overlapped sends the same
    idea by list scheduling (`_greedy_programs`) with 2p in flight, 1F1B's 2p-1 there
    and one more; its ramp is then longer than the closed form counts (a hop costs a
    pair of ticks), e.g. 7.7% against 5.9% at p 4, m 16, equal at p 2 and p 4, m 8."""
    formula = (p - 1) / (3 * m + p - 1)
    if overlap:
        return simulate("zb_h1", p, m, 1, _greedy_programs(p, m, 1, INTERLEAVED, 2 * p, True),
                        formula, overlap=True)
    programs = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        prog = [(F, i, 0) for i in range(warm)]
        nf, nb, nw, rounds = warm, 0, 0, 0
        while nb < m:
            if nf < m:
                prog.append((F, nf, 0))
                nf += 1
            prog.append((B, nb, 0))
            nb += 1
            if rounds >= r:
                prog.append((W, nw, 0))
                nw += 1
            rounds += 1
        prog += [(W, i, 0) for i in range(nw, m)]
        programs.append(prog)
    return simulate("zb_h1", p, m, 1, programs, formula)


def _greedy_programs(p: int, m: int, v: int, placement: str, limit: int,
                     overlap: bool = False) -> list[list[Cell]]:
    """Per-rank programs from lockstep list scheduling: every tick each rank runs the
    first of its ready cells (`Clock`) by priority: a B (the oldest microbatch, the
    later stage first: the backward is the critical path), else an F while fewer than
    `limit` chunk-microbatches are in flight on the rank (the later stage first), else
    the oldest W. `simulate` then builds the table from them. A cell is looked at only
    once what it needs has run (`_unlocked`), so a tick costs what is nearly ready."""
    clock = Clock(stage_map(placement, p, v), overlap)
    stages = clock.stages
    done: dict[tuple[str, int, int], int] = {}
    where = {int(g): (r, c) for (r, c), g in np.ndenumerate(stages)}
    r0, c0 = where[0]
    waiting: list[set] = [set() for _ in range(p)]  # cells whose needs have all run
    waiting[r0].add((F, 0, c0))
    programs: list[list[Cell]] = [[] for _ in range(p)]
    in_flight = [0] * p
    t, quiet, left = 0, 0, 3 * m * v * p
    while left:
        picked = []
        for r in range(p):
            ready = [cell for cell in waiting[r] if clock.ready(cell, r, t, done)]
            b = [c for c in ready if c[0] == B]
            f = [c for c in ready if c[0] == F] if in_flight[r] < limit else []
            w = [c for c in ready if c[0] == W]
            order = (sorted(b, key=lambda c: (c[1], -stages[r][c[2]])) +
                     sorted(f, key=lambda c: (-stages[r][c[2]], c[1])) +
                     sorted(w, key=lambda c: done["B", c[1], stages[r][c[2]]]))
            picked.append(order[0] if order else None)
        quiet = 0 if any(picked) else quiet + 1
        if quiet > 3:
            raise RuntimeError(f"greedy schedule deadlocks at tick {t} (p={p}, m={m})")
        for r, cell in enumerate(picked):
            if cell is not None:
                waiting[r].discard(cell)
                programs[r].append(cell)
                done[clock.letter(cell, r)] = t
                in_flight[r] += 1 if cell[0] == F else -1 if cell[0] == W else 0
                left -= 1
                for rank, next_cell in _unlocked(cell, int(stages[r, cell[2]]), m, where, done):
                    waiting[rank].add(next_cell)
        t += 1
    return programs


def _unlocked(cell: Cell, g: int, m: int, where: dict, done: dict):
    """(rank, cell) of the cells whose needs have all run now that `cell` (at global
    stage g) has: the next stage's F, this stage's B or the previous stage's B, W;
    stage 0's next microbatch."""
    kind, i, _ = cell
    S = len(where)
    if kind == F:
        after = [(F, i, g + 1)] * (g < S - 1) + [(B, i, g)] + [(F, i + 1, 0)] * (g == 0 and i + 1 < m)
    elif kind == B:
        after = [(B, i, g - 1)] * (g > 0) + [(W, i, g)]
    else:
        after = []
    for k, j, h in after:
        if all(need in done for need in _needs(k, j, h, S)):
            rank, chunk = where[h]
            yield rank, (k, j, chunk)


@register("zb_v", chunks=2, placement=V_SHAPE)
def zb_v(p: int, m: int, v: int = 2, overlap: bool = False) -> Schedule:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6; and
    "Pipeline Parallelism with Controllable Memory"): two chunks per rank in V order
    (`stage_map`), B and W split, at most 2p chunk-microbatches in flight per rank (p
    stages' worth: 1F1B's peak). With unit-cost F = B = W the paper's steady state has
    no bubble; what remains in lockstep ticks is the ramp: p - 1 idle ticks of 6m + p - 1,
    (p-1)/(6m+p-1), half ZB-H1's (the same idle ticks over twice as many). With
    overlapped sends 4p in flight (ZB-H1's 2p stages' worth there); a hop then costs a
    pair of ticks and the V's ramp has twice ZB-H1's hops, so its bubble is at most
    ZB-H1's, not half (docs/parallelism.md has the table)."""
    return simulate("zb_v", p, m, 2, _greedy_programs(p, m, 2, V_SHAPE, (4 if overlap else 2) * p,
                                                      overlap),
                    (p - 1) / (6 * m + p - 1), placement=V_SHAPE, overlap=overlap)
