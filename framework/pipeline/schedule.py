"""Pipeline schedules as tables: (tick, stage) -> forward/backward of (microbatch, chunk), or idle.

A table is the single source of truth: the executors read their per-tick actions from
it, the bubble accounting counts its idle cells and `tools/schedule_plot.py` draws it.

* GPipe (Huang et al. 2019): all forwards, then all backwards (the backward half is
  the mirror image that JAX autodiff executes). Bubble (p-1)/(m+p-1).
* Circular / interleaved (Narayanan et al. 2021; MaxText's circular pipeline): each
  rank holds v chunks; microbatches go around the ring v times. Forward of microbatch
  i, chunk v on rank s happens at tick v*m + i + s, which needs m >= p so a microbatch
  is back at rank 0 before rank 0 needs it. Bubble (p-1)/(v*m+p-1).
* 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage s runs min(p-1-s, m) warm-up
  forwards, then alternates one forward and one backward, then drains the backwards.
  With unit-time ticks the table has 2(m+p-1) ticks and bubble (p-1)/(m+p-1), the
  Megatron-LM figure (p-1)/m expressed as a fraction of the whole step. At most
  p - s microbatches are in flight on stage s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IDLE, FWD, BWD = 0, 1, 2
SCHEDULE_NAMES = ("gpipe", "circular", "1f1b")


@dataclass(frozen=True, eq=False)
class Schedule:
    name: str
    n_stages: int
    n_microbatches: int
    n_chunks: int  # chunks per rank (virtual stages)
    action: np.ndarray  # [ticks, stages] IDLE / FWD / BWD
    microbatch: np.ndarray  # [ticks, stages] microbatch index (0 where idle)
    chunk: np.ndarray  # [ticks, stages] chunk index on that rank (0 where idle)
    backward_by_autodiff: bool  # True: the executor runs the FWD rows, autodiff the rest

    @property
    def n_ticks(self) -> int:
        return self.action.shape[0]

    @property
    def busy_per_stage(self) -> np.ndarray:
        return (self.action != IDLE).sum(axis=0)

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-ticks / all stage-ticks, counted on the table."""
        return float((self.action == IDLE).sum() / self.action.size)

    @property
    def formula_bubble(self) -> float:
        """The closed form from the papers cited above."""
        p, m, v = self.n_stages, self.n_microbatches, self.n_chunks
        return (p - 1) / (v * m + p - 1)

    def executed_rows(self) -> "Schedule":
        """The rows an executor runs itself: the forward half for autodiff schedules."""
        if not self.backward_by_autodiff:
            return self
        t = int((self.action == FWD).any(axis=1).nonzero()[0].max()) + 1
        return Schedule(self.name, self.n_stages, self.n_microbatches, self.n_chunks,
                        self.action[:t], self.microbatch[:t], self.chunk[:t], True)

    def max_pending(self, kind: int) -> int:
        """Most messages of one kind (FWD: activations to the next stage, BWD: gradients
        to the previous one) sent on a link but not yet consumed: the receive slots an
        executor needs. A message sent at tick t is usable from tick t + 1."""
        step = 1 if kind == FWD else -1
        worst = 0
        for dst in range(self.n_stages):
            src = dst - step
            if not 0 <= src < self.n_stages:
                continue
            sent = np.cumsum(self.action[:, src] == kind)
            used = np.cumsum(self.action[:, dst] == kind)
            pending = np.concatenate([[0], sent[:-1]]) - np.concatenate([[0], used[:-1]])
            worst = max(worst, int(pending.max()))
        return worst

    def sends(self, kind: int) -> np.ndarray:
        """[ticks] bool: does any rank send a message of this kind after this tick?
        FWD: a forward whose output another rank consumes (every rank but the last,
        and the last too while its chunk goes around the ring again); BWD: a
        backward on any rank but the first."""
        if kind == BWD:
            return (self.action[:, 1:] == BWD).any(axis=1)
        fwd = self.action == FWD
        last_passes_on = fwd[:, -1] & (self.chunk[:, -1] < self.n_chunks - 1)
        return fwd[:, :-1].any(axis=1) | last_passes_on

    def max_in_flight(self) -> np.ndarray:
        """Per stage: the most microbatches whose forward ran but backward did not."""
        live = np.cumsum((self.action == FWD).astype(int) - (self.action == BWD), axis=0)
        return live.max(axis=0)


def _with_mirrored_backward(name, p, m, v, action, micro, chunk) -> Schedule:
    """Appends the backward half that autodiff runs: forward tick t mirrored to tick
    2T-1-t, same stage, same microbatch and chunk."""
    back = np.where(action == FWD, BWD, IDLE)[::-1]
    return Schedule(name, p, m, v,
                    np.concatenate([action, back]),
                    np.concatenate([micro, micro[::-1]]),
                    np.concatenate([chunk, chunk[::-1]]),
                    backward_by_autodiff=True)


def circular(p: int, m: int, v: int) -> Schedule:
    """Circular schedule with v chunks per rank; v = 1 is GPipe."""
    ticks = v * m + p - 1
    k = np.arange(ticks)[:, None] - np.arange(p)[None, :]  # [ticks, stages]
    valid = (k >= 0) & (k < v * m)
    k = np.where(valid, k, 0)
    action = np.where(valid, FWD, IDLE).astype(np.int32)
    micro = (k % m).astype(np.int32)
    chunk = (k // m).astype(np.int32)
    return _with_mirrored_backward("gpipe" if v == 1 else "circular", p, m, v,
                                   action, micro, chunk)


def gpipe(p: int, m: int) -> Schedule:
    return circular(p, m, 1)


def one_f_one_b(p: int, m: int) -> Schedule:
    """Simulates 1F1B with unit-time actions and per-stage program order; an action runs
    at the first tick after everything it depends on has finished."""
    programs = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        prog = [(FWD, i) for i in range(warm)]
        for i in range(m - warm):
            prog += [(FWD, warm + i), (BWD, i)]
        prog += [(BWD, i) for i in range(m - warm, m)]
        programs.append(prog)
    done = {}  # (kind, microbatch, stage) -> tick it ran
    pc = [0] * p
    rows_a, rows_m = [], []
    tick = 0
    while any(pc[s] < len(programs[s]) for s in range(p)):
        act, mic = np.zeros(p, np.int32), np.zeros(p, np.int32)
        for s in range(p):
            if pc[s] == len(programs[s]):
                continue
            kind, i = programs[s][pc[s]]
            if kind == FWD:
                deps = [(FWD, i, s - 1)] if s > 0 else []
            else:
                deps = [(FWD, i, s)] + ([(BWD, i, s + 1)] if s < p - 1 else [])
            if all(done.get(d, tick) < tick for d in deps):
                act[s], mic[s] = kind, i
        for s in range(p):
            if act[s] != IDLE:
                done[(int(act[s]), int(mic[s]), s)] = tick
                pc[s] += 1
        rows_a.append(act)
        rows_m.append(mic)
        tick += 1
    action, micro = np.stack(rows_a), np.stack(rows_m)
    return Schedule("1f1b", p, m, 1, action, micro, np.zeros_like(micro),
                    backward_by_autodiff=False)


def make_schedule(name: str, pipeline: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    if name == "gpipe":
        return gpipe(pipeline, microbatches)
    if name == "circular":
        return circular(pipeline, microbatches, virtual_stages)
    if name == "1f1b":
        return one_f_one_b(pipeline, microbatches)
    raise ValueError(f"unknown schedule {name!r}")
