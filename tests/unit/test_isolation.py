"""tests/isolation.py's `in_own_process`: a native abort reruns once (and a pass after it
warns with what the child printed), a second abort or any other failure fails the test
with the child's output, and a pass runs once (children: isolation_children.py)."""

from types import SimpleNamespace

import pytest

from tests.isolation import in_own_process
from tests.unit.isolation_children import RUNS

CHILDREN = "tests/unit/isolation_children.py"


def _isolate(name: str, tmp_path, monkeypatch):
    """(in_own_process's answer for the child test `name`, how often the child ran)."""
    runs = tmp_path / "runs"
    monkeypatch.setenv(RUNS, str(runs))
    request = SimpleNamespace(node=SimpleNamespace(nodeid=f"{CHILDREN}::{name}"))
    try:
        answer = in_own_process(request)
    finally:
        count = runs.read_text().count("\n") if runs.exists() else 0
    return answer, count


def test_a_pass_runs_once(tmp_path, monkeypatch):
    assert _isolate("test_passes", tmp_path, monkeypatch) == (True, 1)


@pytest.mark.slow  # (8 s; the fast tier <= 5 min: it keeps a pass and a failure)
def test_an_abort_then_a_pass_passes_with_the_abort_quoted(tmp_path, monkeypatch):
    with pytest.warns(UserWarning, match="aborted natively(.|\n)*first run aborts"):
        assert _isolate("test_aborts_once", tmp_path, monkeypatch) == (True, 2)


@pytest.mark.slow  # (5 s)
def test_a_second_abort_fails(tmp_path, monkeypatch):
    with pytest.raises(pytest.fail.Exception, match="after a first run that aborted"):
        _isolate("test_aborts_always", tmp_path, monkeypatch)
    assert (tmp_path / "runs").read_text().count("\n") == 2


def test_a_failure_fails_at_once_with_its_message(tmp_path, monkeypatch):
    with pytest.raises(pytest.fail.Exception, match="a wrong number"):
        _isolate("test_fails", tmp_path, monkeypatch)
    assert (tmp_path / "runs").read_text().count("\n") == 1  # no rerun hides a number
