"""The native libraries' start-up chatter, kept off the run's stderr.

With the ahead-of-time extra installed (`pip install -e '.[aot]'`, docs/compile.md) JAX
loads its CUDA plugin and libtpu on every start, also on a machine with neither. Their C++
code logs to file descriptor 2 before anything can configure it (absl's "All log
messages before absl::InitializeLog() is called ..." and cudart_stub's "Could not find
cuda drivers on your machine"): four lines per process that would break this project's
promise of one stderr line per error. `filtered_stderr` lets those lines go and passes
every other line through, in order, when the block ends.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager

NOISE = (
    "All log messages before absl::InitializeLog() is called",
    "Logging before InitGoogle() is written to STDERR",
    "cudart_stub.cc",  # "Could not find cuda drivers on your machine"
    "Unable to initialize backend 'tpu'",
    "TPU_WORKER_HOSTNAMES",
    "libtpu_init_utils.cc",
    "=== Source Location Trace: ===",
)


_TERMINAL: list[int] = []  # the real stderr's descriptor while fd 2 is redirected here


def terminal_fd() -> int:
    """Where a message for the user goes now (a signal handler may run in a block)."""
    return _TERMINAL[0] if _TERMINAL else 2


@contextmanager
def _fd2_into(target):
    """Within the block, file descriptor 2 writes into the open file `target`; the
    terminal's descriptor is kept for signal handlers (`terminal_fd`)."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(target.fileno(), 2)
    _TERMINAL.append(saved)
    try:
        yield
    finally:
        _TERMINAL.pop()
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


@contextmanager
def filtered_stderr(drop: tuple[str, ...] = NOISE):
    """Within the block, native and Python writes to fd 2 go to a temporary file; at its
    end the lines not containing any of `drop` are written to stderr."""
    try:
        os.fstat(2)
    except OSError:  # no usable fd 2: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        try:
            with _fd2_into(tmp):
                yield
        finally:
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(True)
                    if not any(pattern in line for pattern in drop)]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


@contextmanager
def stderr_to(path):
    """Within the block, everything written to fd 2 (the compilers' own logging: XLA's
    rematerialisation warnings, libtpu's start-up) is appended to the file `path`."""
    with open(path, "ab") as log, _fd2_into(log):
        yield


def native_stderr_into(fd: int) -> None:
    """For the rest of the process, file descriptor 2 (what native code writes) goes to
    `fd`, while Python's sys.stderr and signal handlers keep writing to the terminal
    (framework/runtime/peers.py: a multi-process run's watcher reads the native side)."""
    sys.stderr.flush()
    terminal = os.dup(2)
    os.dup2(fd, 2)
    _TERMINAL.insert(0, terminal)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.stderr.encoding,
                           errors="backslashreplace", closefd=False)


def import_jax() -> None:
    """Imports JAX (which discovers its plugins) with their start-up chatter dropped."""
    if "jax" not in sys.modules:
        with filtered_stderr():
            import jax  # noqa: F401


def start_cpu_only() -> None:
    """For a tool that never runs on a device (it predicts, draws or reads): JAX on
    the CPU alone, started now with the plugins' chatter dropped (on a machine without
    a GPU, JAX's CUDA plugin would print its failed start-up as a traceback)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import_jax()
    with filtered_stderr():
        import jax

        jax.default_backend()
