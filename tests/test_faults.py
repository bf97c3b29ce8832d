"""Checkpoints, resume and faults through the command line, as a user (or a cluster
scheduler) meets them: `python -m framework.run recipe=llama_tiny_debug ...` in
subprocesses, stopped, killed, preempted, diverging, and on two processes.

One uninterrupted 10-step run on Markov data (`full`, losses logged every step, eval
every 5 steps) is the reference that the stopped, killed and two-process runs must
reproduce. Markov, text and token-file data train here; synthetic data in
tests/test_run.py (the default of llama_tiny_debug).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from framework.checkpoint import Checkpointer
from framework.tracking import read_metrics

REPO = Path(__file__).resolve().parent.parent
# Every run here trains the same program (same shapes, same 10-step LR schedule), so
# only the first compiles it and the others load it from the compilation cache.
BASE = ("recipe=llama_tiny_debug", "train.steps=10", "logging.every=1", "eval.every=5",
        "logging.progress=false", "logging=no_wandb")
COMMON = (*BASE, "data=markov")
STEPS = 10


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax_compile_cache")
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}


def command(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "framework.run", *args, f"hydra.run.dir={run_dir}"]


def framework_run(run_dir: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    # One after the other, never side by side: the first run of a program compiles it,
    # the next ones load it from the shared compilation cache.
    return subprocess.run(command(run_dir, *args), cwd=run_dir.parent, env=env,
                          capture_output=True, text=True, timeout=600)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(run_dir: Path, key: str = "train/loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir) if r.get(key) is not None}


def assert_same(got: dict, want: dict, steps) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-6 * abs(want[step]), (step, got, want)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def complete_steps(run_dir: Path) -> list[int]:
    ckpt = Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    try:
        return ckpt.complete_steps()
    finally:
        ckpt.close()


@pytest.fixture(scope="module")
def full(tmp_path_factory, env):
    run_dir = tmp_path_factory.mktemp("full") / "run"
    ok(framework_run(run_dir, *COMMON, env=env))
    return run_dir


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, env):
    """The same run stopped at step 6 (train.stop_at keeps the 10-step LR schedule);
    a copy of its folder, taken then, is returned with it."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    proc = ok(framework_run(run_dir, *COMMON, "train.stop_at=6", env=env))
    copy = run_dir.parent / "copy_at_6"
    shutil.copytree(run_dir, copy)
    return run_dir, copy, proc


def test_uninterrupted_run_logs_eval_loss_entropy_floor_and_a_final_checkpoint(full):
    records = read_metrics(full)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["step"] for r in records if "eval/loss" in r] == [5, 10]
    floor = {r["data/entropy_floor"] for r in records}
    assert len(floor) == 1 and 0 < floor.pop() < np.log(256)  # constant, below uniform
    assert all(np.isfinite(r["eval/loss"]) for r in records if "eval/loss" in r)
    assert complete_steps(full) == [STEPS]  # checkpoint.every=0: the final one only
    assert summary(full)["status"] == "completed"


def test_stop_at_6_then_the_same_command_continues_to_10_exactly(full, stopped, env):
    run_dir, _, first = stopped
    assert "stopped: pp2-dp2-tp2-mb2 | step 6" in first.stdout
    assert summary(run_dir)["status"] == "stopped"
    assert complete_steps(run_dir) == [6]
    resumed = ok(framework_run(run_dir, *COMMON, env=env))
    assert "resuming from the checkpoint of step 6" in resumed.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    assert_same(losses(run_dir), losses(full), range(1, STEPS + 1))
    assert_same(losses(run_dir, "eval/loss"), losses(full, "eval/loss"), (5, 10))
    assert summary(run_dir)["status"] == "completed"
    assert summary(run_dir)["resumed_from_step"] == 6


def checkpoint_is_complete(folder: Path) -> bool:
    """A step folder after its atomic rename (`<step>.orbax-checkpoint-tmp*` is not)."""
    return (folder.name.isdigit() and (folder / "_CHECKPOINT_METADATA").exists()
            and (folder / "metadata" / "metadata").exists())


def test_sigkill_after_the_first_checkpoint_then_the_same_command_finishes(full, tmp_path, env):
    run_dir = tmp_path / "run"
    # Synchronous saves every step: the run is still busy when its first save completes.
    args = (*COMMON, "checkpoint.every=1", "checkpoint.async_save=false")
    proc = subprocess.Popen(command(run_dir, *args), cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not any(checkpoint_is_complete(p) for p in run_dir.glob("checkpoints/*")):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.02)
        assert proc.poll() is None, "the run finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "summary.json").exists()  # it never got to the end

    again = ok(framework_run(run_dir, *args, env=env))
    resumed_from = summary(run_dir)["resumed_from_step"]
    assert f"resuming from the checkpoint of step {resumed_from}" in again.stdout
    assert 1 <= resumed_from < STEPS
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # no gaps, no repeats
    assert_same(losses(run_dir), losses(full), range(resumed_from + 1, STEPS + 1))
    assert_same(losses(run_dir, "eval/loss"), losses(full, "eval/loss"), (10,))
    assert complete_steps(run_dir)[-1] == STEPS
    assert not list(run_dir.glob("checkpoints/*tmp*"))  # a save cut short is cleaned up


def test_non_finite_loss_stops_with_one_line_and_exit_3_keeping_the_last_checkpoint(
        stopped, env):
    _, run_dir, _ = stopped  # the stopped run's folder, with its checkpoint of step 6
    # An absurd learning rate from step 7 on: the loss or gradient norm soon turns NaN.
    proc = framework_run(run_dir, *COMMON, "optim.lr=1e30", env=env)
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: training diverged: non-finite train/")
    last_finite = max(r["step"] for r in read_metrics(run_dir))  # logged every step
    assert 6 < last_finite < STEPS
    assert f"at step {last_finite + 1} " in lines[0]
    assert "newest checkpoint is step 6" in lines[0]
    assert summary(run_dir)["status"] == "diverged"
    assert complete_steps(run_dir) == [6]  # nothing after the last good state

    import jax

    from framework.checkpoint_layout import to_canonical
    from tests.test_run import compose_recipe
    from framework.config import validate
    from framework.engine import build_engine
    from framework.mesh import make_mesh

    cfg = compose_recipe("llama_tiny_debug")
    parallel = validate(cfg.model, cfg.parallel, cfg.train, 8)
    engine = build_engine(cfg.model, parallel, cfg.optim, STEPS, make_mesh(parallel))
    ckpt = Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    try:
        state = ckpt.restore(engine)
    finally:
        ckpt.close()
    assert int(state["step"]) == 6
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(to_canonical(state)))


def corpus(folder: Path) -> Path:
    """A small UTF-8 text file written by the test (no downloads)."""
    text = folder / "corpus.txt"
    words = ["pipeline", "tensor", "data", "mesh", "stage", "gradient", "checkpoint"]
    rng = np.random.default_rng(0)
    text.write_text(" ".join(rng.choice(words, 4000)) + "\n", encoding="utf-8")
    return text


def test_sigterm_saves_a_final_checkpoint_and_exits_0_here_on_a_token_file(tmp_path, env):
    tokens = tmp_path / "corpus.bin"
    load_prepare_data().main([str(tokens), str(corpus(tmp_path))])
    run_dir = tmp_path / "run"
    # Synchronous saves every step: the run is still busy when its first record appears.
    args = (*BASE, "data=tokens", f"data.path={tokens}", "checkpoint.every=1",
            "checkpoint.async_save=false")
    proc = subprocess.Popen(command(run_dir, *args), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        assert proc.poll() is None, "the run finished before it could be preempted"
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    info = summary(run_dir)
    assert info["status"] == "preempted" and 1 <= info["step"] < STEPS
    assert f"preempted: pp2-dp2-tp2-mb2 | step {info['step']}" in out
    assert complete_steps(run_dir)[-1] == info["step"] == info["last_checkpoint_step"]
    assert all(np.isfinite(r["train/loss"]) for r in read_metrics(run_dir))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_of_four_cpu_devices_train_like_one_of_eight(full, tmp_path, env):
    run_dir = tmp_path / "run"
    port = free_port()
    procs = [subprocess.Popen(
        command(run_dir, *COMMON, "devices.platform=cpu",
                "devices.local_device_count=4", "distributed.num_processes=2",
                f"distributed.coordinator_address=127.0.0.1:{port}",
                f"distributed.process_id={i}"),
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "mesh pipe=2 data=2 tensor=2 on 8 cpu devices" in outs[0][0]
    assert "completed:" in outs[0][0] and "completed:" not in outs[1][0]  # process 0 reports
    info = summary(run_dir)
    assert info["n_processes"] == 2 and info["n_devices"] == 8
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    assert_same(losses(run_dir), losses(full), range(1, STEPS + 1))
    assert_same(losses(run_dir, "eval/loss"), losses(full, "eval/loss"), (5, 10))
    assert complete_steps(run_dir) == [STEPS]  # both processes wrote their shards


def load_prepare_data():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_data",
                                                  REPO / "tools" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_text_file_trains_and_evaluates_through_the_command_line(tmp_path, env):
    run_dir = tmp_path / "run"
    ok(framework_run(run_dir, *BASE, "data=text", f"data.path={corpus(tmp_path)}", env=env))
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["train/loss"]) for r in records)
    assert records[-1]["train/loss"] < records[0]["train/loss"]  # a few words: it learns
    assert [r["step"] for r in records if np.isfinite(r.get("eval/loss", np.nan))] == [5, 10]
    assert "data/entropy_floor" not in records[-1]
