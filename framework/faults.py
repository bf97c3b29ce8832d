"""How a run ends early, and what it leaves behind.

    SIGKILL, power loss   nothing runs; checkpoints are atomic (framework/checkpoint.py),
                          so the same command (train.resume=auto) continues from the
                          newest complete one
    SIGTERM               (what schedulers send before preemption) the handler only sets a
                          flag; at the next step boundary the run saves a checkpoint,
                          waits for it and exits 0 with status "preempted"
    train.stop_at         the same, at a chosen step, with status "stopped"
    NaN/inf loss or       `Diverged`: exit status 3 and one line naming the step; the bad
    gradient norm         state is never checkpointed, the last good checkpoint stays newest

Multi-process runs must stop at the same step on every process: there JAX's preemption
service (`multihost_utils.reached_preemption_sync_point`) takes the SIGTERM and the
processes agree on the step; one process alone sets a flag.
"""

from __future__ import annotations

import math
import signal
from typing import Callable

DIVERGED_EXIT = 3  # exit status of a run stopped by a non-finite loss or gradient norm
WATCHED = ("train/loss", "train/grad_norm")


class Diverged(RuntimeError):
    """A non-finite loss or gradient norm (or train state) at `step`."""

    def __init__(self, step: int, message: str):
        self.step = step
        super().__init__(message)

    @classmethod
    def from_values(cls, step: int, values: dict) -> "Diverged":
        bad = [k for k, v in values.items() if not math.isfinite(v)]
        shown = ", ".join(f"{k}={v:.4g}" for k, v in values.items())
        return cls(step, f"non-finite {' and '.join(bad)} at step {step} ({shown})")


def first_non_finite(records: list[tuple[int, dict]]) -> tuple[int, dict] | None:
    """The first (step, values) whose values are not all finite, or None."""
    for step, values in records:
        if not all(math.isfinite(v) for v in values.values()):
            return step, values
    return None


class StopRequests:
    """Answers, at every step boundary, whether the run should stop there, and why.

    Use as a context manager around the loop: in a single process it installs a
    SIGTERM handler that only sets a flag (restored on exit). In a multi-process run
    it asks JAX's preemption service instead, which every process calls at every step
    and which answers True on all of them at the same step."""

    def __init__(self, multi_process: bool = False, stop_at: int | None = None):
        self.multi_process = multi_process
        self.stop_at = stop_at
        self.signalled = False
        self._previous = None

    def __enter__(self) -> "StopRequests":
        if not self.multi_process:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum, frame) -> None:
        self.signalled = True  # acted on at the next step boundary, never here

    def __call__(self, step: int) -> str | None:
        """None to go on, else the reason to stop after `step`."""
        if self.multi_process:
            from jax.experimental import multihost_utils

            preempted = multihost_utils.reached_preemption_sync_point(step)
        else:
            preempted = self.signalled
        if preempted:
            return "preempted"
        if self.stop_at is not None and step >= self.stop_at:
            return "stopped"
        return None


StopCheck = Callable[[int], "str | None"]
