"""Children for tests/unit/test_isolation.py: tests that abort or fail on purpose, run
only as `in_own_process`'s child (this file's name keeps pytest from collecting it
otherwise). Each appends a line to the file `ISOLATION_RUNS` names, so the parent can
count the runs."""

import os
from pathlib import Path

RUNS = "ISOLATION_RUNS"


def _runs() -> int:
    """This run's number (1, 2, ...), recorded."""
    path = Path(os.environ[RUNS])
    before = path.read_text().count("\n") if path.exists() else 0
    with path.open("a") as f:
        f.write("run\n")
    return before + 1


def test_aborts_once():
    if _runs() == 1:
        os.write(2, b"XLA-like message: the first run aborts\n")
        os.abort()


def test_aborts_always():
    _runs()
    os.abort()


def test_fails():
    _runs()
    assert 1 == 2, "a wrong number"


def test_passes():
    _runs()
