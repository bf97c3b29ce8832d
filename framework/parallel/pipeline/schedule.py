"""Pipeline schedules: a registry of table generators (a new schedule is one
generator registered with `@register`; nothing else needs to change). What a table is
made of is in `kinds.py` (the cell kinds, the dependency rule) and `table.py` (the stage
map, the table); the lockstep simulator that turns per-rank programs into a table in
`simulate.py`; everything the executors and the analyses read of a table is compiled
once into a `Program` (`program.py`); a table read from per-rank action lists
(torch.pipelining's CSV) in `actions.py`.

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
  zb_v              (Qi et al. 2024, section 6) two chunks per rank in a V, B and W split.

With overlapped sends (`simulate.py`) 1F1B runs one F and one BW in every pair of its
steady state on every rank: its lockstep ticks are balanced (F + BW each), so its table
bubble is the closed form (synchronous: 40.0% against 27.3% at p 4, m 8, as a rank's F
tick is its neighbour's BW tick). What it costs: a microbatch's round trip from rank r
to the last rank and back takes 2(p-1-r) pairs instead of ticks, so rank r keeps
2(p-1-r)+1 microbatches in flight (Megatron-LM's warm-up with overlapped sends) instead
of p-r: up to 2p-1 stashes instead of p.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np

from framework.parallel.pipeline.kinds import BW, BW_PARTS, IDLE, B, F, W
from framework.parallel.pipeline.simulate import Cell, Clock, greedy_programs, simulate
from framework.parallel.pipeline.table import (AUTODIFF, INTERLEAVED, V_SHAPE, Schedule,
                                               stage_map)


# --- Generators: name -> (p, m, v) -> Schedule ---------------------------------------

@dataclass(frozen=True)
class Generator:
    build: Callable[..., Schedule]  # (p, m, v, overlap) -> Schedule
    uses_virtual_stages: bool  # reads parallel.virtual_stages (else it must be 1)
    check: Callable[[int, int, int], list[str]]  # (p, m, v) -> one-line problems
    chunks: int = 0  # a fixed number of chunks per rank (0: virtual_stages, or 1)
    placement: str = INTERLEAVED
    cuts_backward: bool = False  # build(..., parts=k): BWs cut into k cells (synchronous)
    overlaps: bool = True  # its sends when parallel.overlap_sends is null (unset)


GENERATORS: dict[str, Generator] = {}


def register(name: str, uses_virtual_stages: bool = False,
             check: Callable[[int, int, int], list[str]] = lambda p, m, v: [],
             chunks: int = 0, placement: str = INTERLEAVED, cuts_backward: bool = False,
             overlaps: bool = True):
    """Decorator: `build(p, m, v, overlap) -> Schedule` becomes `parallel.schedule=<name>`
    (`overlap`: `parallel.overlap_sends`, for `simulate`; a table with the default
    overlap=False runs with synchronous sends). `cuts_backward`: build also takes
    `parts`, the cells each BW is cut into with synchronous sends (`table.py`).
    `overlaps`: whether its sends overlap compute unless `parallel.overlap_sends` says."""
    def wrap(build):
        GENERATORS[name] = Generator(build, uses_virtual_stages, check, chunks, placement,
                                     cuts_backward, overlaps)
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


def cuts_backward(name: str) -> bool:
    """The schedule cuts its BWs into parts (`table.py`) when its sends are synchronous."""
    return name in GENERATORS and GENERATORS[name].cuts_backward


def overlaps_by_default(name: str) -> bool:
    """The schedule's sends when `parallel.overlap_sends` is null: overlapped, except
    ZB-V's (synchronous: half ZB-H1's bubble, and no zeros sent, docs/parallelism.md)."""
    return name not in GENERATORS or GENERATORS[name].overlaps


def v_shaped(name: str) -> bool:
    """The schedule places its stages in a V (`stage_map`): the parameter layout follows."""
    return name in GENERATORS and GENERATORS[name].placement == V_SHAPE


def make_schedule(name: str, pipeline: int, microbatches: int, virtual_stages: int = 1,
                  overlap: bool = True, parts: int = 1) -> Schedule:
    """The table of `parallel.schedule`; `overlap`: `parallel.overlap_sends` (tick
    schedules; GPipe and circular send synchronously either way); `parts`: the cells
    each BW is cut into, where the schedule does that (`cuts_backward`, synchronous
    sends; else 1)."""
    problems = check(name, pipeline, microbatches, virtual_stages)
    if problems:
        raise ValueError("; ".join(problems))
    if overlap or not cuts_backward(name):
        parts = 1
    return _build(name, pipeline, microbatches, chunks_per_rank(name, virtual_stages),
                  bool(overlap), int(parts))


_CACHE: dict = {}


def _build(name, p, m, v, overlap, parts) -> Schedule:
    key = (name, p, m, v, overlap, parts)
    if key not in _CACHE:
        gen = GENERATORS[name]
        extra = {"parts": parts} if gen.cuts_backward else {}
        _CACHE[key] = gen.build(p, m, v, overlap=overlap, **extra)
    return _CACHE[key]


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


def forward_only(p: int, m: int, v: int, placement: str = INTERLEAVED) -> Schedule:
    """The forward rows alone, each rank running its chunks in order and each chunk's
    microbatches in order, every cell as early as its input allows: what evaluation
    runs (forward only, the stages where the training schedule placed them). With the
    interleaved placement and m >= p it is the circular table's forward half."""
    stages = stage_map(placement, p, v)
    programs = [[(F, i, c) for c in np.argsort(stages.of[r]) for i in range(m)]
                for r in range(p)]
    table = simulate("forward", m, programs, (p - 1) / (v * m + p - 1),
                     Clock(stages, overlap=False))
    return dataclasses.replace(table, executor=AUTODIFF)


@register("gpipe")
def gpipe(p: int, m: int, v: int = 1, overlap: bool = False) -> Schedule:
    return circular(p, m, 1)


register("circular", uses_virtual_stages=True, check=_circular_check)(circular)


def _one_f_one_b_programs(p: int, m: int, v: int, overlap: bool,
                          parts: int = 1) -> list[list[Cell]]:
    """Megatron-LM's (interleaved) 1F1B order. Virtual microbatch k of a rank is
    microbatch (k // (p*v)) * p + k % p of chunk (k // p) % v (forward; the backward
    visits the chunks in reverse). Rank r warms up with (p-1-r) + (v-1)*p forwards,
    then alternates F and BW; with overlapped sends with 2(p-1-r) + (v-1)*p, Megatron-
    LM's warm-up when its sends overlap compute: a round trip to the last rank then
    takes 2(p-1-r) tick pairs, each with one F and one BW. With `parts` > 1 each BW is
    its parts, top first (`table.py`): every cell then costs one F."""
    def cell(kind, k):
        group = k % (p * v)
        chunk = group // p if kind == F else v - 1 - group // p
        return (kind, (k // (p * v)) * p + k % p, chunk)

    def backward(k):
        if parts == 1:
            return [cell(BW, k)]
        return [cell(BW_PARTS[j], k) for j in reversed(range(parts))]

    programs = []
    for r in range(p):
        n = m * v
        warm = min((p - 1 - r) * (2 if overlap else 1) + (v - 1) * p, n)
        prog = [cell(F, k) for k in range(warm)]
        for k in range(n - warm):
            prog += [cell(F, warm + k), *backward(k)]
        prog += [c for k in range(n - warm, n) for c in backward(k)]
        programs.append(prog)
    return programs


@register("1f1b", cuts_backward=True)
def one_f_one_b(p: int, m: int, v: int = 1, overlap: bool = False, parts: int = 1) -> Schedule:
    return simulate("1f1b", m, _one_f_one_b_programs(p, m, 1, overlap, parts),
                    (p - 1) / (m + p - 1), Clock.of(p, 1, overlap, parts=parts))


def _interleaved_check(p, m, v):
    if m % p:
        return [f"parallel.microbatches={m} is not a multiple of parallel.pipeline={p}: "
                f"the interleaved 1F1B schedule runs microbatches in groups of pipeline "
                f"(use {max(p, m // p * p)} or {(m // p + 1) * p})"]
    return []


@register("interleaved_1f1b", uses_virtual_stages=True, check=_interleaved_check,
          cuts_backward=True)
def interleaved_1f1b(p: int, m: int, v: int, overlap: bool = False,
                     parts: int = 1) -> Schedule:
    return simulate("interleaved_1f1b", m, _one_f_one_b_programs(p, m, v, overlap, parts),
                    (p - 1) / (v * m + p - 1),
                    Clock.of(p, v, overlap, parts=parts))


@register("zb_h1")
def zb_h1(p: int, m: int, v: int = 1, overlap: bool = False) -> Schedule:
    """ZB-H1 (Qi et al. 2024, section 2.1). Rank r: 1F1B's p-1-r warm-up forwards, then
    F, B and W in turn, except that its first r rounds skip the W (run at the very end):
    every rank then holds p microbatches between F and W, the peak 1F1B has on rank 0,
    and the postponed W's fill the drain's idle ticks. With overlapped sends the same
    idea by list scheduling (`greedy_programs`) with 2p in flight, 1F1B's 2p-1 there
    and one more; its ramp is then longer than the closed form counts (a hop costs a
    pair of ticks), e.g. 7.7% against 5.9% at p 4, m 16, equal at p 2 and p 4, m 8."""
    formula = (p - 1) / (3 * m + p - 1)
    if overlap:
        return simulate("zb_h1", m, greedy_programs(p, m, 1, INTERLEAVED, 2 * p, True),
                        formula, Clock.of(p, overlap=True))
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
    return simulate("zb_h1", m, programs, formula, Clock.of(p))


@register("zb_v", chunks=2, placement=V_SHAPE, overlaps=False)
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
    return simulate("zb_v", m, greedy_programs(p, m, 2, V_SHAPE, (4 if overlap else 2) * p,
                                               overlap),
                    (p - 1) / (6 * m + p - 1), Clock.of(p, 2, overlap, V_SHAPE))
