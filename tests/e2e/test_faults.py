"""Checkpoints, resume and faults through the command line, as a user (or a cluster
scheduler) meets them: `python -m framework.run recipe=llama_tiny_debug ...` in
subprocesses, stopped, killed, preempted, diverging, sharing a folder, with damaged
checkpoints, on a full disk, and on two processes.

One uninterrupted 10-step run on Markov data (`full`, losses logged every step, eval
every 5 steps, a checkpoint after every step) is the reference that the stopped,
killed, fallen-back and two-process runs must reproduce; while it runs, a second run
tries its folder. Markov, text and token-file data train here; synthetic data in
tests/e2e/test_run.py (the default of llama_tiny_debug).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from framework.io.checkpoint.manager import Checkpointer
from framework.run.tracking import read_metrics
from tests import cli
from tests.cli import assert_same, command, complete_steps, losses, ok, summary
from tests.cli import train as framework_run
from tests.helpers import load_tool

# Every run here trains the same program (same shapes, same 10-step LR schedule); no
# profile window (its timed bubble is tested in test_run.py), except where the test says.
BASE = ("recipe=llama_tiny_debug", "train.steps=10", "logging.every=1", "eval.every=5",
        "logging.progress=false", "logging=no_wandb", "profile.steps=0")
COMMON = (*BASE, "data=markov")
STEPS = 10
EVERY_STEP = ("checkpoint.every=1", f"checkpoint.keep={STEPS}")  # all steps kept


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    """(run folder, pid, the second run's result): the reference run, frozen (SIGSTOP)
    once it holds its folder while a second run on the same folder is tried."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    proc = subprocess.Popen(command(run_dir, *COMMON, *EVERY_STEP), cwd=run_dir.parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for(lambda: (run_dir / "run.lock").exists(), proc)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            second = framework_run(run_dir, *COMMON, env=env)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return run_dir, proc.pid, second


@pytest.fixture(scope="module")
def full(reference):
    return reference[0]


def wait_for(condition, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"waited {seconds} s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, env):
    """The same run stopped at step 6 (train.stop_at keeps the 10-step LR schedule);
    a copy of its folder, taken then, is returned with it."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    proc = ok(framework_run(run_dir, *COMMON, "train.stop_at=6", env=env))
    copy = run_dir.parent / "copy_at_6"
    shutil.copytree(run_dir, copy)
    return run_dir, copy, proc


def test_sigterm_during_compilation_exits_0_with_nothing_new_to_save(tmp_path, env):
    """The SIGTERM, sent just after the start line, arrives while the run compiles (on
    CPU with several devices nothing is loaded from a compilation cache). The run
    finishes compiling and stops."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command(run_dir, *COMMON), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("mesh pipe=2 data=2 tensor=2")
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and err == "", err[-3000:]
    assert out.splitlines()[0] == ("SIGTERM before the first step: nothing new to save "
                                   "(no checkpoint yet)")
    assert out.splitlines()[1].startswith("preempted: pp2-dp2-tp2-mb2 | step 0 |")
    info = summary(run_dir)
    assert info["status"] == "preempted" and info["step"] == 0
    assert complete_steps(run_dir) == [] and read_metrics(run_dir) == []


def _handlers_installed(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Waits until `proc` catches SIGTERM (Linux: /proc/PID/status, SigCgt): its early
    handlers are installed, SIGINT's first (framework/runtime/faults.py). A signal
    before that, in the interpreter's own start-up, meets the default action: CI sent
    one 0.2 s after the start on a loaded machine, and the process died of it (-15)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        caught = next(int(s.split()[1], 16) for s in status if s.startswith("SigCgt:"))
        if caught >> (signal.SIGTERM - 1) & 1:
            return
        time.sleep(0.005)
    proc.kill()
    raise AssertionError(f"no SIGTERM handler after {timeout} s (exit {proc.wait()}): "
                         f"{proc.stderr.read()[-2000:]}")


def test_sigterm_and_ctrl_c_in_the_first_instant_end_with_one_line(tmp_path, env):
    for sig, status, line in [
            (signal.SIGTERM, 143, "stopped: SIGTERM before the run started, nothing to save"),
            (signal.SIGINT, 130, "error: interrupted before the run started, nothing to save")]:
        proc = subprocess.Popen(command(tmp_path / "run", *COMMON), cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _handlers_installed(proc)  # the first instant the run can answer a signal
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, err, out) == (status, line + "\n", ""), (sig, err)


def test_uninterrupted_run_logs_eval_loss_entropy_floor_and_a_final_checkpoint(full):
    records = read_metrics(full)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["step"] for r in records if "eval/loss" in r] == [5, 10]
    floor = {r["data/entropy_floor"] for r in records}
    assert len(floor) == 1 and 0 < floor.pop() < np.log(256)  # constant, below uniform
    assert all(np.isfinite(r["eval/loss"]) for r in records if "eval/loss" in r)
    assert complete_steps(full) == list(range(1, STEPS + 1))
    assert summary(full)["status"] == "completed"
    assert not (full / "run.lock").exists()  # released at the end


def test_a_second_run_on_a_busy_folder_exits_2_and_the_first_loses_nothing(reference):
    run_dir, pid, second = reference
    assert second.returncode == 2, second.stderr[-3000:]
    line = second.stderr.strip()
    assert line.startswith(f"error: {run_dir} is in use by another run (host ")
    assert f", pid {pid}, started 20" in line and "\n" not in line
    assert "mesh pipe=" not in second.stdout  # refused before JAX started
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, STEPS + 1))


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
    """Also: the killed run's lock is stale and taken over; its W&B run is continued."""
    run_dir = tmp_path / "run"
    # Synchronous saves every step: the run is still busy when its first save completes.
    args = (*COMMON, "checkpoint.every=1", "checkpoint.async_save=false",
            "logging.wandb.mode=offline")
    proc = subprocess.Popen(command(run_dir, *args), cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(checkpoint_is_complete(p) for p in run_dir.glob("checkpoints/*")),
                 proc)
        assert proc.poll() is None, "the run finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert summary(run_dir)["status"] == "running"  # it never got to the end
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == proc.pid  # left behind

    again = ok(framework_run(run_dir, *args, env=env))  # the stale lock does not block it
    assert not (run_dir / "run.lock").exists()
    resumed_from = summary(run_dir)["resumed_from_step"]
    assert f"resuming from the checkpoint of step {resumed_from}" in again.stdout
    assert 1 <= resumed_from < STEPS
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # no gaps, no repeats
    assert_same(losses(run_dir), losses(full), range(resumed_from + 1, STEPS + 1))
    assert_same(losses(run_dir, "eval/loss"), losses(full, "eval/loss"), (10,))
    assert complete_steps(run_dir)[-1] == STEPS
    assert not list(run_dir.glob("checkpoints/*tmp*"))  # a save cut short is cleaned up
    # One W&B run: the restart continued the killed run's id (one folder per invocation).
    runs = sorted(p.name for p in run_dir.glob("wandb/offline-run-*"))
    assert len(runs) == 2 and len({name.rsplit("-", 1)[1] for name in runs}) == 1, runs


def _data_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.glob("state/**/d/*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def _flip_a_byte(step_dir: Path) -> None:
    _flip(_data_file(step_dir))


def _flip(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


# The five newest checkpoints of a copy of the reference, each damaged another way.
DAMAGE = {
    10: ("a truncated data file", lambda d: os.truncate(_data_file(d),
                                                        _data_file(d).stat().st_size // 2)),
    9: ("a flipped byte", _flip_a_byte),
    8: ("a missing index file", lambda d: (d / "state" / "manifest.ocdbt").unlink()),
    7: ("no state/", lambda d: shutil.rmtree(d / "state")),
    6: ("no completion marker", lambda d: (d / "_CHECKPOINT_METADATA").unlink()),
}


def test_damaged_checkpoints_are_moved_aside_and_the_run_falls_back(full, tmp_path, env):
    """Each damaged checkpoint gives one line and a fall back to the previous one (a
    chain here: 10 falls back to 9, which is damaged too, ...): the run resumes from
    step 5, saves steps 6-10 again and ends with the reference's losses."""
    run_dir = tmp_path / "run"
    shutil.copytree(full, run_dir)
    for step, (_, damage) in DAMAGE.items():
        damage(run_dir / "checkpoints" / str(step))
    proc = ok(framework_run(run_dir, *COMMON, *EVERY_STEP, env=env))
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(DAMAGE), proc.stderr
    for step in DAMAGE:
        line = next(ln for ln in lines if f"checkpoint of step {step} in" in ln)
        assert line.startswith("warning: the checkpoint of step"), line
        assert f"moved aside to {run_dir / 'checkpoints' / f'{step}.damaged'}" in line
    assert "fingerprint" not in lines[0] and "arrays differ from what was saved" in next(
        ln for ln in lines if "step 9 in" in ln)  # flipped bytes: only the fingerprints see it
    assert "resuming from the checkpoint of step 5 in" in proc.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    assert_same(losses(run_dir), losses(full), range(1, STEPS + 1))
    assert_same(losses(run_dir, "eval/loss"), losses(full, "eval/loss"), (5, 10))
    assert complete_steps(run_dir) == list(range(1, STEPS + 1))  # 6-10 saved again
    assert all((run_dir / "checkpoints" / f"{s}.damaged").is_dir() for s in DAMAGE)


def _can_mount_tmpfs(where: Path) -> bool:
    """A real, small tmpfs needs no root inside a user + mount namespace (unshare -rm),
    where the kernel allows unprivileged user namespaces."""
    if shutil.which("unshare") is None:
        return False
    where.mkdir(exist_ok=True)
    probe = subprocess.run(["unshare", "-rm", "sh", "-c",
                            f"mount -t tmpfs -o size=1m tmpfs {where}"],
                           capture_output=True, timeout=60)
    return probe.returncode == 0


def test_a_full_disk_stops_the_run_with_one_line_and_keeps_earlier_checkpoints(
        full, tmp_path, env):
    """A 5 MB tmpfs holds two checkpoints (2.2 MB each): the third save fails in the
    background (ENOSPC). The run stops at the next step boundary with one line, exit 4;
    after the space is grown, the same command resumes from the newest good checkpoint
    and ends with the reference's losses. Where no tmpfs can be mounted, the file-size
    limit of the running process is lowered instead (the kernel then fails the same
    writes with EFBIG). Where a tmpfs can be mounted, the whole run folder's test below
    checks the same on it (one run of three commands less in the suite)."""
    run_dir, mnt = tmp_path / "run", tmp_path / "mnt"
    if _can_mount_tmpfs(mnt):
        pytest.skip("covered by the whole run folder on a tmpfs (the test below)")
    # keep=2: a save that pruned before it succeeded would lose the older of the two.
    args = [*COMMON, "checkpoint.every=1", "checkpoint.keep=2", f"checkpoint.dir={mnt / 'ck'}"]
    if _can_mount_tmpfs(mnt):
        first, second = (" ".join(command(run_dir, *args)) + f" 2>{tmp_path / name}"
                         for name in ("err1", "err2"))
        script = (f"mount -t tmpfs -o size=5m tmpfs {mnt} && {first}; echo first=$?; "
                  f"echo kept: $(ls {mnt / 'ck'}); "
                  f"mount -o remount,size=64m {mnt} && {second}; echo second=$?")
        proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        out, reason = proc.stdout, "No space left on device (errno 28)"
        errs = [(tmp_path / name).read_text() for name in ("err1", "err2")]
    else:
        import resource

        mnt.mkdir(exist_ok=True)
        proc = subprocess.Popen(command(run_dir, *args), cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: checkpoint_is_complete(mnt / "ck" / "2"), proc)
        os.kill(proc.pid, signal.SIGSTOP)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (300_000, 300_000))
        os.kill(proc.pid, signal.SIGCONT)
        out1, err1 = proc.communicate(timeout=600)
        kept = " ".join(sorted(p.name for p in (mnt / "ck").iterdir()))
        again = framework_run(run_dir, *args, env=env)
        out = (f"{out1}first={proc.returncode}\nkept: {kept}\n{again.stdout}"
               f"second={again.returncode}\n")
        reason, errs = "File too large (errno 27)", [err1, again.stderr]
    assert "first=4" in out and "second=0" in out, (out, errs)
    line = errs[0].strip()
    assert "\n" not in line and line.startswith("error: could not save the checkpoint of "
                                                 "step "), errs[0]
    assert f" in {mnt / 'ck'}: {reason}; a checkpoint needs about 2.2 MB, " in line
    newest = int(line.split("the newest good checkpoint is step ")[1].split()[0])
    assert newest >= 2 and errs[1] == ""
    kept = next(ln for ln in out.splitlines() if ln.startswith("kept:")).split()[1:]
    assert sorted(int(n) for n in kept if n.isdigit()) == [newest - 1, newest], kept
    assert f"resuming from the checkpoint of step {newest} in {mnt / 'ck'}" in out
    assert summary(run_dir)["status"] == "completed"
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    assert_same(losses(run_dir), losses(full), range(1, STEPS + 1))


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

    from framework.engine.state import to_canonical
    from tests.helpers import compose_recipe
    from framework.engine.validate import validate
    from framework.engine.build import build_engine
    from framework.parallel.mesh import make_mesh

    cfg = compose_recipe("llama_tiny_debug")
    parallel = validate(cfg.model, cfg.parallel, cfg.train, 8)
    engine = build_engine(cfg.model, parallel, cfg.optim, STEPS, make_mesh(parallel))
    ckpt = Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    try:
        state = ckpt.restore(engine.layout)
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
    load_prepare_data().build([str(tokens), str(corpus(tmp_path))])
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


def _two_processes(run_dir: Path, port: int, env: dict) -> list[subprocess.Popen]:
    return [subprocess.Popen(
        command(run_dir, *COMMON, "checkpoint.every=2", "devices.platform=cpu",
                "devices.local_device_count=4", "distributed.num_processes=2",
                f"distributed.coordinator_address=127.0.0.1:{port}",
                f"distributed.process_id={i}", f"distributed.heartbeat_timeout_s={HEARTBEAT}"),
        cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for i in range(2)]


HEARTBEAT = 5  # distributed.heartbeat_timeout_s of the two-process runs


def _kill_at(run_dir: Path, step: int, victim: int, env: dict) -> None:
    """Two processes on `run_dir`; `victim` SIGKILLed once `step` is logged: the other
    ends within the heartbeat timeout (plus slack) with one line naming it, and
    summary.json says failed."""
    procs = _two_processes(run_dir, cli.free_port(), env)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and step in [
            r["step"] for r in read_metrics(run_dir)], procs[0])
        procs[victim].kill()
        killed = time.monotonic()
        out, err = procs[1 - victim].communicate(timeout=HEARTBEAT + 60)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
            p.communicate()
    assert procs[1 - victim].returncode != 0 and took < HEARTBEAT + 30, (took, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: process {victim} of 2 vanished after step "), err[-3000:]
    assert lines[0].endswith("restart every process with the same command to resume")
    assert "newest complete checkpoint is step" in lines[0] or "no checkpoint" in lines[0]
    info = summary(run_dir)
    assert info["status"] == "failed" and f"process {victim} of 2" in info["reason"]
    assert all(np.isfinite(r["train/loss"]) for r in read_metrics(run_dir))


def test_two_processes_survive_dead_peers_and_train_like_one_of_eight(full, tmp_path, env):
    """2 processes x 4 CPU devices form the 8-device mesh. One of them, drawn (process
    0 is the coordinator), is SIGKILLed at a random step; restarted, the run ends with
    the losses of one process with 8 devices. (Until 2026-12-01 both were killed in
    turn, one restart each: 2 minutes of the suite on 2 cores.)"""
    run_dir = tmp_path / "run"
    rng = np.random.default_rng()
    _kill_at(run_dir, int(rng.integers(2, STEPS - 1)), int(rng.integers(0, 2)), env)

    again = _two_processes(run_dir, cli.free_port(), env)
    outs = [p.communicate(timeout=600) for p in again]
    for p, (out, err) in zip(again, outs):
        assert p.returncode == 0, err[-3000:]
    assert "mesh pipe=2 data=2 tensor=2 on 8 cpu devices" in outs[0][0]
    assert "completed:" in outs[0][0] and "completed:" not in outs[1][0]  # process 0 reports
    info = summary(run_dir)
    assert info["n_processes"] == 2 and info["n_devices"] == 8
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    assert_same(losses(run_dir), losses(full), range(1, STEPS + 1))
    assert_same(losses(run_dir, "eval/loss"), losses(full, "eval/loss"), (5, 10))
    assert complete_steps(run_dir)[-1] == STEPS  # both processes wrote their shards


def load_prepare_data():
    return load_tool("prepare_data")


def test_a_text_file_trains_and_evaluates_through_the_command_line(tmp_path, env):
    run_dir = tmp_path / "run"
    ok(framework_run(run_dir, *BASE, "data=text", f"data.path={corpus(tmp_path)}", env=env))
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["train/loss"]) for r in records)
    assert records[-1]["train/loss"] < records[0]["train/loss"]  # a few words: it learns
    assert [r["step"] for r in records if np.isfinite(r.get("eval/loss", np.nan))] == [5, 10]
    assert "data/entropy_floor" not in records[-1]


GREEDY = ("prompt_ids=1,2,3", "max_new_tokens=6", "temperature=0", "print_ids=true",
          "platform=cpu")


def _generate(env, cwd, *args):
    return subprocess.run([sys.executable, "-m", "framework.generate", *args, *GREEDY],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_generate_and_export_never_read_a_damaged_checkpoint(full, tmp_path, env):
    """Generation and export check the fingerprints as training's restore does: the
    newest step bit-flipped, the one before truncated: both fall back to step 8 with a
    line each and give what step 8 gives; naming a damaged step is one line, exit 2."""
    run_dir = tmp_path / "run"
    shutil.copytree(full, run_dir)
    # Every data file of the two newest steps (so the parameters' blocks are hit too):
    # one byte flipped in each of step 10's, each of step 9's cut to half its size.
    for path in (run_dir / "checkpoints" / "10").glob("state/**/d/*"):
        _flip(path)
    for path in (run_dir / "checkpoints" / "9").glob("state/**/d/*"):
        os.truncate(path, path.stat().st_size // 2)
    fallback = _generate(env, tmp_path, f"checkpoint={run_dir}")
    assert fallback.returncode == 0, fallback.stderr[-2000:]
    warnings = [ln for ln in fallback.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 2 and "using step 9" in warnings[0] and "using step 8" in warnings[
        1], fallback.stderr[-3000:]
    assert all(" is damaged: " in w for w in warnings), warnings
    eight = ok(_generate(env, tmp_path, f"checkpoint={run_dir}", "step=8"))
    assert fallback.stdout == eight.stdout and fallback.stdout.strip()
    named = _generate(env, tmp_path, f"checkpoint={run_dir}", "step=10")
    assert named.returncode == 2 and len(named.stderr.strip().splitlines()) == 1
    assert "step 10" in named.stderr and "name another step" in named.stderr
    exported = ok(cli.tool("export_hf", str(run_dir), str(tmp_path / "hf"), env=env))
    assert "using step 8" in exported.stderr
    ok(cli.tool("export_hf", str(run_dir), str(tmp_path / "hf8"), "--step", "8", env=env))
    assert ((tmp_path / "hf" / "model.safetensors").read_bytes()
            == (tmp_path / "hf8" / "model.safetensors").read_bytes())


def test_the_whole_run_folder_on_a_full_disk_ends_in_one_line_and_resumes(full, tmp_path,
                                                                          env):
    """Everything of the run (metrics, logs, profile, summary, checkpoints) on one 5 MB
    tmpfs: exit 4 with one line, a valid summary.json (`failed`), every metrics line
    valid; a restart on the still-full disk is one line too; with space the same
    command ends with the reference's losses. The line names the reason and the newest
    good checkpoint, both kept (keep=2: a save that pruned before it succeeded would
    lose the older of the two), which the restart resumes from. Needs a tmpfs (skipped
    where the kernel refuses unprivileged mounts; the checkpoint-folder test above
    covers that case, with a lowered file-size limit)."""
    mnt = tmp_path / "mnt"
    if not _can_mount_tmpfs(mnt):
        pytest.skip("no unprivileged tmpfs here")
    run_dir = mnt / "run"
    run = " ".join(command(run_dir, *COMMON, "checkpoint.every=1", "checkpoint.keep=2",
                           "profile.steps=2"))
    check = (f"{sys.executable} -c \"import json; s = json.load(open('{run_dir}/summary.json'));"
             f" [json.loads(l) for l in open('{run_dir}/metrics.jsonl')]; print(s['status'])\"")
    script = (f"mount -t tmpfs -o size=5m tmpfs {mnt} && {run} 2>{tmp_path / 'err1'}; "
              f"echo first=$?; {check}; echo kept: $(ls {run_dir / 'checkpoints'}); "
              f"{run} 2>{tmp_path / 'err2'}; echo second=$?; "
              f"mount -o remount,size=64m {mnt} && {run} 2>{tmp_path / 'err3'}; echo third=$?; "
              f"cp {run_dir}/metrics.jsonl {tmp_path}/metrics.jsonl")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    errs = [(tmp_path / f"err{i}").read_text().strip().splitlines() for i in (1, 2, 3)]
    # The restart on the still-full disk stops at its lock file (exit 2) or, when that
    # still fits, at its first save (exit 4): one line either way.
    assert "first=4" in proc.stdout and re.search("second=[24]\n", proc.stdout), (
        proc.stdout, errs)
    assert "\nfailed\n" in proc.stdout and "third=0" in proc.stdout, (proc.stdout, errs)
    assert len(errs[0]) == 1 and errs[0][0].startswith("error: could not save the checkpoint")
    assert (f" in {run_dir / 'checkpoints'}: No space left on device (errno 28); a "
            "checkpoint needs about ") in errs[0][0], errs[0]
    newest = int(errs[0][0].split("the newest good checkpoint is step ")[1].split()[0])
    kept = next(ln for ln in proc.stdout.splitlines() if ln.startswith("kept:")).split()[1:]
    assert newest >= 2 and sorted(int(n) for n in kept if n.isdigit()) == [newest - 1, newest]
    assert f"resuming from the checkpoint of step {newest} in " in proc.stdout
    assert len(errs[1]) == 1 and errs[1][0].startswith("error: "), errs[1]
    assert errs[2] == []
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    got = {r["step"]: r["train/loss"] for r in records if "train/loss" in r}
    assert_same(got, losses(full), range(1, STEPS + 1))


def test_a_shard_damaged_during_the_run_stops_it_in_one_line_with_its_checkpoints(tmp_path,
                                                                                 env):
    """A corpus shard truncated while the run trains: the next read of it is one line
    naming the file (exit 5, DataError), summary.json says failed, and the checkpoints
    saved before are intact: with the shard restored the run resumes from the last."""
    folder = tmp_path / "c"
    load_tool("prepare_data").build([str(folder), str(corpus(tmp_path)), "--processes", "1"])
    shard = next(folder.glob("shard-*.bin"))
    whole = shard.read_bytes()
    run_dir = tmp_path / "run"
    base = tuple(a for a in BASE if not a.startswith(("train.steps=", "eval.every=")))
    args = (*base, "data=corpus", f"data.path={folder}", "eval.every=0",
            "checkpoint.every=1", "checkpoint.async_save=false", "data.prefetch=0")
    proc = subprocess.Popen(command(run_dir, *args, "train.steps=400"), cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        with open(shard, "r+b") as f:
            f.truncate(len(whole) // 2)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 5 and len(lines) == 1, err[-3000:]
    assert shard.name in lines[0] and "changed during the run" in lines[0]
    info = summary(run_dir)
    assert info["status"] == "failed" and complete_steps(run_dir)[-1] >= 2
    shard.write_bytes(whole)
    last = complete_steps(run_dir)[-1]
    ok(framework_run(run_dir, *args, f"train.steps={last + 1}", env=env))
    assert summary(run_dir)["step"] == last + 1
