"""The training loop: feeds batches to the engine's pure jitted step and hangs the
side effects (metrics, progress, checkpoints, evaluation, stopping) off it.

Timing. JAX dispatches steps asynchronously, so the loop only waits for the device
when it must: to log, to run a hook, or to check the loss. A log window's wall time,
minus the time spent in hooks, divided by its steps is `perf/step_time_s`. Compilation
happens before the loop (`Engine.compile`), and the first step, which still pays
one-off costs (buffer allocation, first transfers), is timed on its own and kept out of
every throughput number.

Data. The batches of the coming steps are read and placed on the mesh by a background
thread (`Prefetch`, `LoopSettings.prefetch` steps ahead) while the devices compute;
`perf/data_wait_fraction` is the share of a log window's time the loop spent waiting
for a batch (0 when the loader keeps ahead; with prefetch 0, all the reading time).

Faults (framework/runtime/faults.py). The loss and gradient norm of every step are checked on
the host whenever the loop waits anyway (at log steps, before hooks, at the end), so a
NaN is reported at the step it first appeared and no hook (no checkpoint) ever sees
the state it produced. `stop(step)` is asked at every step boundary (SIGTERM,
train.stop_at) and ends the loop there.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import jax
import numpy as np

from framework.runtime.faults import WATCHED, StopCheck, first_non_finite
from framework.errors import Diverged
from framework.model import fp8

Batches = Callable[[int], Any]  # step index -> tokens [global_batch, seq_len + 1]


class Logger(Protocol):
    def log(self, step: int, metrics: dict) -> None: ...

    def update(self, step: int) -> None: ...


@dataclass
class LoopSettings:
    steps: int  # train until this many optimizer steps are done
    log_every: int
    start: int = 0  # steps already done (a resumed run starts later)
    constants: dict = field(default_factory=dict)  # added to every record (e.g. memory)
    once: dict = field(default_factory=dict)  # added to the first record only
    # Step time in seconds -> the perf/* metrics of a record (tokens/s, TFLOP/s, MFU).
    perf: Callable[[float], dict] = lambda step_time: {}
    prefetch: int = 2  # batches made ahead in a background thread (0: when needed)


class Prefetch:
    """`batches(index)` for index = start, start + 1, ... made by a background thread,
    at most `depth` ahead (memory: `depth` batches); called in that order. An error
    making a batch (e.g. a shard damaged during the run) is raised by the call that
    wanted it."""

    def __init__(self, batches: Batches, start: int, stop: int, depth: int):
        self.next, self.done = start, threading.Event()
        self.queue: queue.Queue = queue.Queue(maxsize=depth)

        def work():
            for index in range(start, stop):
                try:
                    item = (index, batches(index), None)
                except BaseException as err:  # handed to the loop's thread
                    item = (index, None, err)
                while not self.done.is_set():
                    try:
                        self.queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if item[2] is not None or self.done.is_set():
                    return

        self.thread = threading.Thread(target=work, name="prefetch", daemon=True)
        self.thread.start()

    def __call__(self, index: int):
        got, batch, err = self.queue.get()
        assert got == index == self.next, (got, index, self.next)
        self.next += 1
        if err is not None:
            raise err
        return batch

    def close(self):
        """Stops the thread and waits for it: a thread still inside JAX's C++ code (a
        batch being placed) when the process exits aborted it ("FATAL: exception not
        rethrown", measured on a run stopped by a full disk)."""
        self.done.set()
        self.thread.join(timeout=120)


@dataclass
class Hook:
    """A side effect after some steps: `fn(step, state)` returns metrics for that step's
    record (e.g. eval/loss), or None. Due every `every` steps (0: never) and, with
    `at_end`, after step `LoopSettings.steps`. `after_log` hooks run once the step's
    record is written: a checkpoint must never be on disk without the records of the
    steps it contains, or a run resumed from it would miss them."""

    name: str
    every: int
    fn: Callable[[int, Any], dict | None]
    at_end: bool = False
    after_log: bool = False

    def due(self, step: int, last: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or (self.at_end and step == last)


@dataclass
class ProfileWindow:
    """Steps `first`..`last` (step numbers) run under a profiler: `start()` before the
    first, `stop()` after the last (the loop waits for it) returns metrics added to
    every later record. The traced steps are left out of the throughput."""

    first: int
    last: int
    start: Callable[[], None]
    stop: Callable[[], dict]


@dataclass
class LoopResult:
    state: Any
    step: int  # optimizer steps done
    first_step_s: float | None  # wall time of this run's first step (None: no step run)
    stopped: str | None = None  # None: reached settings.steps; else why it stopped early


def is_log_step(step: int, settings: LoopSettings) -> bool:
    return step % settings.log_every == 0 or step == settings.steps


def to_host(value) -> np.ndarray:
    """A device value as numpy, also when other processes hold parts of it."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable \
            and not value.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def check_finite(unchecked: list) -> None:
    """Raises Diverged at the first of these steps with a non-finite loss or gradient
    norm, or (model.fp8) a non-finite FP8 matmul input; empties the list (of (step,
    device metrics))."""
    keys = [k for k in WATCHED + fp8.WATCHED if unchecked and k in unchecked[0][1]]
    values = jax.device_get([[m[k] for k in keys] for _, m in unchecked])
    found = first_non_finite([(step, {k: float(v) for k, v in zip(keys, row)})
                              for (step, _), row in zip(unchecked, values)])
    unchecked.clear()
    if found is not None:
        raise Diverged.from_values(*found)


class _Clock:
    """The current throughput window: wall time since it began, steps timed in it, and
    time spent in hooks (subtracted)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.start, self.steps, self.paused = time.perf_counter(), 0, 0.0
        self.waited = 0.0  # for batches, within the window

    def step_time(self) -> float | None:
        elapsed = time.perf_counter() - self.start - self.paused
        return elapsed / self.steps if self.steps else None

    def wait_fraction(self) -> float | None:
        elapsed = time.perf_counter() - self.start - self.paused
        return min(1.0, self.waited / elapsed) if self.steps and elapsed > 0 else None


def train_loop(engine, state, batches: Batches, settings: LoopSettings, logger: Logger,
               hooks: tuple[Hook, ...] = (), stop: StopCheck | None = None,
               profile: ProfileWindow | None = None) -> LoopResult:
    """Runs steps `settings.start + 1 .. settings.steps`, or until `stop(step)` gives a
    reason. Raises Diverged (framework/runtime/faults.py) on a non-finite loss or
    gradient norm."""
    after = _AfterStep(engine, settings, logger, hooks, pending_once=dict(settings.once))
    clock, first_step_s = after.clock, None
    step, stopped = settings.start, None
    if settings.prefetch:
        batches = Prefetch(batches, settings.start, settings.steps, settings.prefetch)
    try:
        for index in range(settings.start, settings.steps):
            if profile is not None and index + 1 == profile.first:
                jax.block_until_ready(state)  # the trace holds the profiled steps only
                profile.start()
                after.tracing = True
            waiting = time.perf_counter()
            batch = engine.shard_batch(batches(index))
            clock.waited += time.perf_counter() - waiting
            state, metrics = engine.step(state, batch)
            step = index + 1
            after.unchecked.append((step, metrics))
            if first_step_s is None:  # excluded from throughput: wait, restart the clock
                jax.block_until_ready(metrics)
                first_step_s = time.perf_counter() - clock.start
                clock.reset()
            elif not after.tracing:
                clock.steps += 1
            stopped = stop(step) if stop is not None else None  # every process, every step
            stopped = None if step == settings.steps else stopped  # done anyway
            if after.tracing and (step == profile.last or stopped):
                jax.block_until_ready(state)
                after.tracing = False
                found = profile.stop()
                settings.constants.update({k: v for k, v in found.items() if isinstance(v, float)})
                clock.reset()  # the traced steps ran slower: no window contains them
            after(state, metrics, step, stopped)
            if stopped:
                break
    finally:
        if isinstance(batches, Prefetch):
            batches.close()
        if after.tracing:  # an error while tracing: end the trace (the error is what counts)
            try:
                jax.profiler.stop_trace()
            except Exception:  # e.g. no space left for the trace
                pass
    return LoopResult(state, step, first_step_s, stopped)


@dataclass
class _AfterStep:
    """What follows every step: its checks, hooks and (if due) record. Holds what the
    loop keeps between steps: the throughput window, the steps whose loss is not checked
    yet, the one-off metrics not logged yet, and whether the profiler is tracing."""

    engine: Any
    settings: LoopSettings
    logger: Logger
    hooks: tuple[Hook, ...]
    clock: _Clock = field(default_factory=_Clock)
    unchecked: list = field(default_factory=list)  # (step, device metrics) not checked yet
    pending_once: dict = field(default_factory=dict)
    tracing: bool = False

    def __call__(self, state, metrics: dict, step: int, stopped: str | None) -> None:
        settings, clock = self.settings, self.clock
        due = [hook for hook in self.hooks if hook.due(step, settings.steps)]
        log_now = is_log_step(step, settings)
        if due or log_now or stopped or step == settings.steps:
            check_finite(self.unchecked)  # waits for this step
        extra: dict = {}
        started = time.perf_counter()
        for hook in due:
            if not hook.after_log:
                extra.update(hook.fn(step, state) or {})
        clock.paused += time.perf_counter() - started
        self.logger.update(step)
        if log_now or extra:
            self.logger.log(step, self._record(metrics, extra))
            clock.reset()
        started = time.perf_counter()
        for hook in due:
            if hook.after_log:
                hook.fn(step, state)
        clock.paused += time.perf_counter() - started

    def _record(self, metrics: dict, extra: dict) -> dict:
        """The step's record: its metrics, the window's step time and perf/* metrics, the
        constants, the one-off metrics not logged yet and the hooks' `extra`."""
        record = self.engine.host_metrics({k: to_host(v) for k, v in metrics.items()})
        step_time = None if self.tracing else self.clock.step_time()
        record["perf/step_time_s"] = step_time
        record["perf/data_wait_fraction"] = None if self.tracing else self.clock.wait_fraction()
        # Nothing timed yet (only the first step in this window): same keys, null values.
        perf = self.settings.perf
        record.update(perf(step_time) if step_time else dict.fromkeys(perf(1.0)))
        record.update(self.settings.constants)
        record.update(self.pending_once)
        record.update(extra)
        self.pending_once = {}
        return record
