"""The command lines, run as a user runs them, for the end-to-end tests: each call is a
subprocess (`python -m framework.run ...`, `python -m framework.generate ...`, a tool),
with the environment of `tests/e2e/conftest.py` (fixture `env`)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from framework.io.checkpoint.manager import Checkpointer
from framework.run.tracking import read_metrics

from tests.helpers import REPO


def command(run_dir: Path, *args: str) -> list[str]:
    """`python -m framework.run <args> hydra.run.dir=<run_dir>`."""
    return [sys.executable, "-m", "framework.run", *args, f"hydra.run.dir={run_dir}"]


def train(run_dir: Path, *args: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    """A training run in `run_dir`, started from its parent folder (one after the other,
    never side by side: the machine's cores are shared)."""
    return subprocess.run(command(run_dir, *args), cwd=run_dir.parent, env=env,
                          capture_output=True, text=True, timeout=timeout)


def framework(module: str, *args: str, cwd: Path, env: dict,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m framework.<module> <args>` from `cwd` (e.g. outside the repository)."""
    return subprocess.run([sys.executable, "-m", f"framework.{module}", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def tool(name: str, *args: str, env: dict | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess:
    """`python tools/<name>.py <args>`."""
    return subprocess.run([sys.executable, str(REPO / "tools" / f"{name}.py"), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A free TCP port on localhost (for a coordinator of several processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def one_error_line(proc: subprocess.CompletedProcess, status: int = 2) -> str:
    """The single `error: ...` line a refused command prints (asserted), without the prefix."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == status, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0].removeprefix("error: ")


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def losses(run_dir: Path, key: str = "train/loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir) if r.get(key) is not None}


def assert_same(got: dict, want: dict, steps) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-6 * abs(want[step]), (step, got, want)


def complete_steps(run_dir: Path) -> list[int]:
    ckpt = Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    try:
        return ckpt.complete_steps()
    finally:
        ckpt.close()
