"""The training loop: feeds batches to the engine's pure jitted step and hangs the
side effects (metrics, progress, later checkpoints and evaluation) off it.

Timing. JAX dispatches steps asynchronously, so the loop only waits for the device
when it logs: a log window's wall time divided by its steps is `perf/step_time_s`.
Compilation happens before the loop (`Engine.compile`), and the first step, which
still pays one-off costs (buffer allocation, first transfers), is timed on its own
and kept out of every throughput number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import jax
import numpy as np

Batches = Callable[[int], np.ndarray]  # step index -> tokens [global_batch, seq_len + 1]


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


def is_log_step(step: int, settings: LoopSettings) -> bool:
    return step % settings.log_every == 0 or step == settings.steps


def train_loop(engine, state, batches: Batches, settings: LoopSettings, logger: Logger,
               perf: Callable[[float], dict], hooks: tuple = ()):
    """Runs steps `settings.start + 1 .. settings.steps`; returns (state, first_step_s).

    perf: step time in seconds -> the perf/* metrics (tokens/s, TFLOP/s, MFU).
    hooks: callables `hook(step, state)` run after every step (checkpoints, eval)."""
    window_start, window_steps, first_step_s = time.perf_counter(), 0, None
    pending_once = dict(settings.once)
    for index in range(settings.start, settings.steps):
        state, metrics = engine.step(state, engine.shard_batch(batches(index)))
        step = index + 1
        if first_step_s is None:  # excluded from throughput: wait for it, restart the clock
            jax.block_until_ready(metrics)
            now = time.perf_counter()
            first_step_s, window_start = now - window_start, now
        else:
            window_steps += 1
        for hook in hooks:
            hook(step, state)
        logger.update(step)
        if not is_log_step(step, settings):
            continue
        record = engine.host_metrics(metrics)  # waits for this step to finish
        now = time.perf_counter()
        step_time = (now - window_start) / window_steps if window_steps else None
        record["perf/step_time_s"] = step_time
        # Nothing timed yet (only the first step in this window): same keys, null values.
        record.update(perf(step_time) if step_time else dict.fromkeys(perf(1.0)))
        record.update(settings.constants)
        record.update(pending_once)
        pending_once = {}
        logger.log(step, record)
        window_start, window_steps = time.perf_counter(), 0
    return state, first_step_s
