"""A test that runs again in a process of its own (`in_own_process`), for the one case
whose process XLA:CPU ended twice in CI with a native abort (exit 134, SIGABRT): the
8-device interleaved FSDP-and-experts case of tests/parity/test_dense_prefix.py, on
2026-11-29 and 2026-11-30, 85-88% of the way through the suite; alone, twice at a time
and beside a CPU burner here it passed 17 of 17 times. A native abort inside a pytest-xdist
worker loses the test's captured output (XLA's own message with it), and with
`--dist loadfile` the replaced worker then left the run hanging until CI's time limit
(pytest-xdist issue #784). In a child process the abort is an exit status, XLA's message
is kept, and the suite goes on.

A child that died of SIGABRT runs once more; a second abort fails the test with what
XLA printed, and an abort followed by a pass passes with a warning that quotes it (in
pytest's -ra summary), so it stays visible. Any other failure (a wrong loss, a wrong
gradient) fails at once: no retry hides a number.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings

import pytest

from tests.helpers import REPO

CHILD = "FRAMEWORK_TEST_CHILD"  # set in the child: run the test's body there
ABORTED = (-signal.SIGABRT, 128 + signal.SIGABRT)
TIMEOUT_S = 900


def in_own_process(request) -> bool:
    """True where the caller should return at once: this (parent) process ran the test
    in a child, which passed. False in the child: run the body. Fails the test where
    the child failed (its output's tail in the message)."""
    if os.environ.get(CHILD):
        return False
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-n", "0", "-p", "no:cacheprovider",
           request.node.nodeid]
    env = dict(os.environ, **{CHILD: "1"})
    first = _run(cmd, env)
    if first.returncode == 0:
        return True
    if first.returncode not in ABORTED:
        _fail(first)
    second = _run(cmd, env)
    if second.returncode != 0:
        _fail(second, first)
    warnings.warn(f"{request.node.nodeid}: the first run aborted natively (exit "
                  f"{first.returncode}) and the second passed; the first printed: "
                  f"{_said(first)}")
    return True


def _run(cmd, env) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # (a hang: a failure, never a retry)
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(cmd, 124, out, f"timed out after {TIMEOUT_S} s")


def _said(proc: subprocess.CompletedProcess, n: int = 2000) -> str:
    """What the aborted child printed on stderr, less faulthandler's Python stacks (XLA's
    own message is in what is left)."""
    stack = ("  File ", "Thread 0x", "Current thread", "Extension modules", "Stack (most")
    lines = [ln for ln in (proc.stderr or "").splitlines()
             if ln.strip() and not ln.startswith(stack)]
    return "\n".join(lines)[-n:]


def _tail(proc: subprocess.CompletedProcess, n: int = 6000) -> str:
    return ((proc.stdout or "") + "\n--- stderr ---\n" + (proc.stderr or ""))[-n:]


def _fail(proc: subprocess.CompletedProcess, earlier=None) -> None:
    before = "" if earlier is None else (
        f"(after a first run that aborted, exit {earlier.returncode}:\n{_tail(earlier, 3000)})\n")
    pytest.fail(f"the test's own process exited {proc.returncode}:\n{before}{_tail(proc)}",
                pytrace=False)
