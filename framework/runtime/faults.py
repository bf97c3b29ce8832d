"""How a run ends early, and what it leaves behind (docs/checkpoints-and-faults.md has the table).

    SIGKILL, power loss   nothing runs; checkpoints are atomic (framework/io/checkpoint/manager.py),
                          so the same command (train.resume=auto) continues from the
                          newest complete one; lost: the steps since it, at most one
                          checkpoint interval plus the save that was in flight
    SIGTERM               (what schedulers send before preemption) before the run holds
                          its folder: one line, exit 143, nothing touched; later, the
                          handler only sets a flag: before the first step (restoring,
                          compiling) the run exits 0 with nothing new to save, after it
                          the run saves a checkpoint at the next step boundary, waits for
                          it and exits 0; summary status "preempted" in both cases
    Ctrl-C (SIGINT)       before the run holds its folder: one line, exit 130; later
                          KeyboardInterrupt (saves in flight finish), exit 130
    train.stop_at         like SIGTERM after the first step, at a chosen step ("stopped")
    NaN/inf loss or       `Diverged`: exit status 3 and one line naming the step; the bad
    gradient norm         state is never checkpointed, the last good checkpoint stays newest
    a failed save         `StorageError` (disk full, permissions, quota): noticed at the
                          next step boundary, exit status 4 and one line; earlier
                          checkpoints are untouched

The SIGTERM/SIGINT handlers are installed first thing in the process
(`install_early_handlers`, from framework/run/cli.py, before Hydra or JAX are imported);
`run_started()` marks the moment the run holds its folder.

Multi-process runs must stop at the same step on every process: there JAX's preemption
service (`multihost_utils.reached_preemption_sync_point`) takes the SIGTERM and the
processes agree on the step (a SIGTERM before the first step then also stops after it);
one process alone sets a flag.

While a run goes on, what background threads print (Orbax's save threads, TensorStore
callbacks: tracebacks when a save fails) and the records of the `absl`, `asyncio` and
`framework.details` loggers go to `run.log` only (`LibraryOutput`, installed by
framework/run/cli.py); the terminal keeps the run's own lines, and a failure is reported
there in one line.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
from typing import Callable

DIVERGED_EXIT = 3  # exit status of a run stopped by a non-finite loss or gradient norm
STORAGE_EXIT = 4  # a checkpoint (or metrics.jsonl) could not be written
DATA_EXIT = 5  # the training data was damaged during the run (errors.DataError)
INTERRUPTED_EXIT = 130  # 128 + SIGINT
SIGTERM_BEFORE_START_EXIT = 143  # 128 + SIGTERM: stopped before the run held its folder
WATCHED = ("train/loss", "train/grad_norm")


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
            self.signalled = self.signalled or _PROCESS.sigterm  # sent before this point
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum, frame) -> None:
        self.signalled = True  # acted on at the next step boundary, never here

    def before_first_step(self) -> bool:
        """A SIGTERM came before the first step (while restoring or compiling): stop
        now, nothing new to save. (Multi-process runs stop after one step instead.)"""
        return not self.multi_process and self.signalled

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


# --- Signals from the first instant ----------------------------------------------------

class _ProcessState:
    installed = False  # install_early_handlers() ran (the command line)
    running = False  # the run holds its folder: SIGTERM only sets `sigterm`
    sigterm = False
    sweep = False  # this process launches a sweep's jobs (each in its own process)


_PROCESS = _ProcessState()


def _say_and_exit(message: str, status: int) -> None:
    # Nothing imported here: the signal may arrive while the main thread imports the
    # module (an import from the handler then failed on the partly made module, a
    # traceback and exit 1, in CI on 2026-12-01). Before quiet.py has redirected fd 2
    # (its `terminal_fd` defined and called), fd 2 is the terminal.
    terminal_fd = getattr(sys.modules.get("framework.runtime.quiet"), "terminal_fd", None)
    os.write(terminal_fd() if terminal_fd else 2, (message + "\n").encode())
    os._exit(status)  # nothing of the run exists yet: no cleanup to do


SWEEP_STOPPED = ("the sweep stops: the job in progress ends on its own (its folder's "
                 "summary.json says how), the jobs after it do not start")


def _early_sigterm(signum, frame) -> None:
    if _PROCESS.sweep:
        _say_and_exit(f"stopped: SIGTERM: {SWEEP_STOPPED}", SIGTERM_BEFORE_START_EXIT)
    if not _PROCESS.running:
        _say_and_exit("stopped: SIGTERM before the run started, nothing to save",
                      SIGTERM_BEFORE_START_EXIT)
    _PROCESS.sigterm = True  # the run stops at its next chance (StopRequests)


def _early_sigint(signum, frame) -> None:
    if _PROCESS.sweep:
        _say_and_exit(f"error: interrupted: {SWEEP_STOPPED}", INTERRUPTED_EXIT)
    if not _PROCESS.running:
        _say_and_exit("error: interrupted before the run started, nothing to save",
                      INTERRUPTED_EXIT)
    signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as usual


def install_early_handlers() -> None:
    """SIGTERM and SIGINT handling for the whole process, installed before anything
    slow is imported (see the module docstring for what each does when)."""
    signal.signal(signal.SIGINT, _early_sigint)
    signal.signal(signal.SIGTERM, _early_sigterm)  # last: SIGTERM caught = both installed
    _PROCESS.installed = True


def command_line() -> bool:
    """This process is `python -m framework.run` (the early handlers are installed)."""
    return _PROCESS.installed


def sweep_started() -> None:
    """This process launches a sweep's jobs: a signal stops the sweep, not a run."""
    _PROCESS.sweep = True


def run_started() -> None:
    """The run holds its folder: from now on a SIGTERM is a request to stop."""
    _PROCESS.running = True


# --- Library output to run.log ---------------------------------------------------------

QUIET_LOGGERS = ("absl", "asyncio", "framework.details")


class _ThreadRouter:
    """sys.stderr for the run: the main thread writes to the terminal, other threads
    (Orbax's, TensorStore's callbacks) append to the log file."""

    def __init__(self, terminal, log_path: str):
        self.terminal, self.log_path = terminal, log_path
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        if threading.current_thread() is threading.main_thread():
            return self.terminal.write(text)
        with self._lock:
            try:
                with open(self.log_path, "a") as f:
                    f.write(text)
            except OSError:
                pass
        return len(text)

    def flush(self) -> None:
        self.terminal.flush()

    def __getattr__(self, name):
        return getattr(self.terminal, name)


def _for_terminal(record: logging.LogRecord) -> bool:
    return not (record.name.split(".")[0] in ("absl", "asyncio")
                or record.name.startswith("framework.details")
                or record.threadName != "MainThread")


class LibraryOutput:
    """Background threads' prints and the QUIET_LOGGERS' records reach run.log but not
    the terminal: `install()` for the rest of the process (the command line: TensorStore
    callbacks of a failed save may still print while the process exits), or use as a
    context manager."""

    def __init__(self, log_path: str):
        self.log_path = str(log_path)
        self._stderr = None

    def install(self) -> "LibraryOutput":
        self._stderr = sys.stderr
        sys.stderr = _ThreadRouter(sys.stderr, self.log_path)
        # "Exception ignored in ..." (e.g. a restore's coroutine collected after a damaged
        # checkpoint was given up): ignored by definition, so to run.log only.
        self._unraisable, sys.unraisablehook = sys.unraisablehook, self._to_log
        self._handlers = [h for h in logging.getLogger().handlers
                          if type(h) is logging.StreamHandler]
        # A log file on a full disk: drop the record instead of printing "--- Logging
        # error ---" and a traceback to the terminal for every record that follows.
        self._raise, logging.raiseExceptions = logging.raiseExceptions, False
        for handler in self._handlers:
            handler.addFilter(_for_terminal)
        return self

    def _to_log(self, unraisable) -> None:
        import traceback

        text = "".join(traceback.format_exception(
            unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))
        try:
            with open(self.log_path, "a") as f:
                f.write(f"{unraisable.err_msg or 'Exception ignored in'}: "
                        f"{unraisable.object!r}\n{text}")
        except OSError:
            pass

    def uninstall(self) -> None:
        if self._stderr is not None:
            sys.stderr = self._stderr
            self._stderr = None
            sys.unraisablehook = self._unraisable
            logging.raiseExceptions = self._raise
        for handler in self._handlers:
            handler.removeFilter(_for_terminal)

    def __enter__(self) -> "LibraryOutput":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()
