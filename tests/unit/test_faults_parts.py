"""The fault-handling pieces without a training run: the run-folder lock and its stale
rules, metrics.jsonl on resume, checkpoint fingerprints, one-line wording of storage
errors and missing devices, sweep folder names, and every impossible number through the
command line's entry point (in this process: the same code path as
`python -m framework.run`, with a check that nothing reaches the devices)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework import errors
from framework.io.checkpoint import integrity
from framework.runtime import devices, runlock
from framework.run import sweep, tracking
from framework.config import ParallelConfig
from framework.errors import StorageError


# --- The run-folder lock ----------------------------------------------------------------

def test_a_second_lock_on_a_folder_is_refused_naming_the_holder(tmp_path):
    lock = runlock.acquire(tmp_path / "run")
    held = json.loads((tmp_path / "run" / runlock.LOCK_FILE).read_text())
    assert held["pid"] == os.getpid() and held["host"]
    with pytest.raises(errors.FolderBusy) as refused:
        runlock.acquire(tmp_path / "run")
    line = str(refused.value)
    assert "\n" not in line and str(tmp_path / "run") in line
    assert f"pid {os.getpid()}" in line and held["started"] in line
    assert runlock.holder(tmp_path / "run").pid == os.getpid()
    lock.release()
    assert not (tmp_path / "run" / runlock.LOCK_FILE).exists()
    assert runlock.holder(tmp_path / "run") is None
    runlock.acquire(tmp_path / "run").release()  # free again


def _write_lock(folder, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    base = {"host": "elsewhere", "pid": 1, "started": "2026-01-01 00:00:00"}
    (folder / runlock.LOCK_FILE).write_text(json.dumps({**base, **fields}))
    return folder / runlock.LOCK_FILE


def test_stale_locks_are_taken_over_live_ones_are_not(tmp_path):
    import socket

    # Same host, a pid that no longer runs (a child that has exited): stale.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    _write_lock(tmp_path / "dead", host=socket.gethostname(), pid=child.pid)
    runlock.acquire(tmp_path / "dead").release()
    # Same host, pid alive but started at another tick: the pid was reused, stale.
    _write_lock(tmp_path / "reused", host=socket.gethostname(), pid=os.getppid(),
                proc_start="1")
    if runlock._proc_start(os.getppid()) is not None:
        runlock.acquire(tmp_path / "reused").release()
    # Another host, heartbeat recent: live. Old heartbeat: stale.
    path = _write_lock(tmp_path / "remote")
    with pytest.raises(errors.FolderBusy, match="host elsewhere, pid 1"):
        runlock.acquire(tmp_path / "remote")
    old = os.stat(path).st_mtime - runlock.STALE_AFTER_S - 5
    os.utime(path, (old, old))
    assert runlock.holder(tmp_path / "remote") is None
    runlock.acquire(tmp_path / "remote").release()
    # An unreadable lock counts as live until its age says otherwise.
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / runlock.LOCK_FILE).write_text("{not json")
    with pytest.raises(errors.FolderBusy, match="an unreadable lock"):
        runlock.acquire(tmp_path / "garbled")


def test_the_holder_keeps_its_lock_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.05)
    lock = runlock.acquire(tmp_path)
    path = tmp_path / runlock.LOCK_FILE
    os.utime(path, (1, 1))
    import time

    deadline = time.monotonic() + 10
    while os.stat(path).st_mtime < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.stat(path).st_mtime > 1e9  # touched by the heartbeat
    lock.release()


def test_a_sweep_never_writes_into_a_job_folder_another_run_holds(tmp_path):
    job = tmp_path / "pp2-dp2-tp2-mb2"
    (job / ".hydra").mkdir(parents=True)
    (job / "summary.json").write_text('{"status": "running elsewhere"}')
    (job / ".hydra" / "overrides.yaml").write_text("- the other run's\n")
    lock = runlock.acquire(job)
    try:
        got = sweep.run_job(["recipe=llama_tiny_debug"], job, "group", job.name,
                            {"pipeline": 2}, dict(os.environ))
    finally:
        lock.release()
    assert got["status"] == "skipped" and "is in use by another run" in got["reason"]
    assert (job / "summary.json").read_text() == '{"status": "running elsewhere"}'
    assert (job / ".hydra" / "overrides.yaml").read_text() == "- the other run's\n"


# --- metrics.jsonl ------------------------------------------------------------------------

def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_lines_are_whole_and_a_resume_checks_and_keeps_what_it_drops(tmp_path):
    path = tmp_path / tracking.METRICS_FILE
    sink = tracking.JsonlSink(tmp_path)
    for step in (1, 2, 3, 4):
        sink.log(step, {"train/loss": 1.0 / step, "x": "y" * 5000})  # longer than a buffer
    sink.sync()
    sink.finish({})
    assert [r["step"] for r in _records(path)] == [1, 2, 3, 4]
    # Resume at 3 with a garbled line in the middle: it is dropped, but the original
    # file is kept beside it first; the result is checked.
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{garbled", *lines[1:]]) + "\n")
    resumed = tracking.JsonlSink(tmp_path, resumed_at=3)
    resumed.finish({})
    assert [r["step"] for r in _records(path)] == [1, 2, 3]
    assert resumed.kept_aside == tmp_path / "metrics.jsonl.1"
    assert "{garbled" in resumed.kept_aside.read_text()
    # A clean resume (records after the step, a last line cut by a kill) keeps nothing.
    with open(path, "a") as f:
        f.write(json.dumps({"step": 4}) + '\n{"step": 5, "tr')
    assert tracking.JsonlSink(tmp_path, resumed_at=3).kept_aside is None
    # A fresh start never overwrites earlier records.
    fresh = tracking.JsonlSink(tmp_path)
    fresh.finish({})
    assert path.read_text() == "" and len(_records(tmp_path / "metrics.jsonl.2")) == 3
    with pytest.raises(StorageError, match="is not as written"):
        path.write_text('{"step": 2}\n{"step": 1}\n')
        tracking.check_metrics(path, 3)


def test_the_wandb_run_of_a_folder_is_found_by_its_folder_name(tmp_path):
    assert tracking.previous_wandb_id(tmp_path) is None
    (tmp_path / "wandb" / "offline-run-20261123_101010-abc123").mkdir(parents=True)
    assert tracking.previous_wandb_id(tmp_path) == "abc123"  # no .wandb file needed
    (tmp_path / "wandb" / "offline-run-20261123_111111-abc123").mkdir()
    assert tracking.previous_wandb_id(tmp_path) == "abc123"


# --- Checkpoint fingerprints and storage errors --------------------------------------------

def test_fingerprints_change_with_any_single_bit_and_not_with_the_layout():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)
    base = np.asarray(integrity.fingerprint(x))
    flat_bits = np.asarray(x).view(np.uint32).reshape(-1)
    for i, bit in [(0, 0), (17, 31), (511, 13), (300, 22)]:
        changed = flat_bits.copy()
        changed[i] ^= np.uint32(1 << bit)
        y = jnp.asarray(changed.view(np.float32).reshape(x.shape))
        assert np.all(np.asarray(integrity.fingerprint(y)) != base), (i, bit)
    swapped = np.asarray(x).copy()
    swapped[0, 0, [0, 1]] = swapped[0, 0, [1, 0]]
    assert np.any(np.asarray(integrity.fingerprint(jnp.asarray(swapped))) != base)
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    sharded = jax.device_put(x, jax.NamedSharding(mesh, jax.P("a", None, "b")))
    assert np.array_equal(np.asarray(jax.jit(integrity.fingerprint)(sharded)), base)
    for dtype in (jnp.bfloat16, jnp.int32, jnp.uint8, jnp.bool_):
        assert integrity.fingerprint(jnp.ones((3, 5), dtype)).dtype == jnp.uint32


def test_storage_errors_are_named_in_words():
    err = ValueError("RESOURCE_EXHAUSTED: Error writing \"x\": Failed to write 624411 bytes "
                     "to file 5: No space left on device [os_error_code='28'] "
                     "[tensorstore_spec='{...}']")
    assert integrity.short_reason(err) == "No space left on device (errno 28)"
    assert integrity.short_reason(PermissionError(13, "Permission denied")) == (
        "Permission denied (errno 13)")
    long = RuntimeError("NOT_FOUND: gone [tensorstore_spec='{\"a\": 1}']\nmore")
    assert integrity.short_reason(long) == "RuntimeError: NOT_FOUND: gone"


def test_a_missing_gpu_is_explained_without_rocm():
    err = RuntimeError("Unable to initialize backend 'rocm': Backend 'rocm' is not in the "
                       "list of known backends: ['cpu', 'tpu'].")
    text = devices._missing_platform("gpu", err)
    assert "rocm" not in text.lower() and "GPU" in text


def test_sweep_folders_of_jobs_whose_data_degree_cannot_be_resolved():
    assert sweep.mesh_label(ParallelConfig(3, -1, 1, 2)) == "pp3-dpfill-tp1-mb2"
    assert sweep.mesh_label(ParallelConfig(2, 4, 1, 2)) == "pp2-dp4-tp1-mb2"


# --- Impossible numbers: exit 2, one line, before anything runs --------------------------

BAD_NUMBERS = [
    ("optim.lr=-1", "optim.lr=-1.0 must be >= 0"),
    ("optim.lr=nan", "optim.lr=nan must be a finite number >= 0"),
    ("optim.lr=inf", "optim.lr=inf must be a finite number"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1 must be >= 0"),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 must be >= 0"),
    ("optim.grad_clip=-1", "optim.grad_clip=-1.0 must be >= 0"),
    ("optim.b1=1", "optim.b1=1.0 must be in [0, 1)"),
    ("optim.b2=-0.5", "optim.b2=-0.5 must be in [0, 1)"),
    ("optim.eps=0", "optim.eps=0.0 must be > 0"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio=2.0 must be in [0, 1]"),
    ("optim.z_loss=-1", "optim.z_loss=-1.0 must be >= 0"),
    ("optim.decay_steps=0", "optim.decay_steps=0 must be >= 1"),
    ("optim.schedule=step", "optim.schedule='step' is not one of cosine, linear, constant, wsd"),
    ("optim.mu_dtype=int8", "optim.mu_dtype='int8' is not one of float32, bfloat16"),
    ("optim.param_dtype=float16",
     "optim.param_dtype='float16' is not one of float32, bfloat16"),
    ("optim.name=sgd", "optim.name='sgd' is not one of adamw, muon"),
    ("optim.muon_momentum=1", "optim.muon_momentum=1.0 must be in [0, 1)"),
    ("train.seq_len=0", "train.seq_len=0 must be >= 1"),
    ("train.global_batch_size=0", "train.global_batch_size=0 must be >= 1"),
    ("train.steps=0", "train.steps=0 must be >= 1"),
    ("train.seed=-1", "train.seed=-1 must be in [0, 4.29497e+09]"),
    ("train.stop_at=0", "train.stop_at=0 must be >= 1"),
    ("data.holdout_fraction=1", "data.holdout_fraction=1.0 must be in [0, 1)"),
    ("data.markov_concentration=0", "data.markov_concentration=0.0 must be > 0"),
    ("eval.every=-5", "eval.every=-5 must be >= 0"),
    ("eval.batches=0", "eval.batches=0 must be >= 1"),
    ("checkpoint.every=-1", "checkpoint.every=-1 must be >= 0"),
    ("checkpoint.keep=0", "checkpoint.keep=0 must be >= 1"),
    ("logging.every=0", "logging.every=0 must be >= 1"),
    ("model.n_heads=0", "model.n_heads=0 must be >= 1"),
    ("model.norm_eps=-1", "model.norm_eps=-1.0 must be > 0"),
    ("devices.local_device_count=0", "devices.local_device_count=0 must be >= 1"),
]


def _cli_in_this_process(monkeypatch, tmp_path, *args) -> tuple[int, str]:
    """`python -m framework.run recipe=llama_tiny_debug <args>` through its entry point,
    with devices.start replaced by a tripwire: reaching it fails the test."""
    from framework.run import cli as run_cli

    def tripwire(*a, **k):
        raise AssertionError("the run reached the devices")

    monkeypatch.setattr(devices, "start", tripwire)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # main() sets it; restored afterwards
    monkeypatch.setattr(sys, "argv", ["framework.run", "recipe=llama_tiny_debug",
                                      f"hydra.run.dir={tmp_path / 'run'}",
                                      "hydra/job_logging=none",
                                      "hydra/hydra_logging=none", *args])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        run_cli.main()
    return exited.value.code, err.getvalue()


@pytest.mark.slow
def test_every_impossible_number_is_one_line_and_exit_2(monkeypatch, tmp_path):
    for setting, message in BAD_NUMBERS:
        code, err = _cli_in_this_process(monkeypatch, tmp_path, setting)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (setting, err)
        assert lines[0] == f"error: {message}" or lines[0].startswith(f"error: {message}"), (
            setting, lines[0])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("args, message", [
    (("+train.stpes=5",), "+train.stpes is not a setting (did you mean train.steps?)"),
    (("+foo=1",), "+foo is not a setting"),
    (("hydra.run.dir=",), "hydra.run.dir is empty: name the run's folder"),
    (("data.path=/tmp/données.txt",), "cannot read the override data.path=/tmp/données.txt: "
                                       "quote the value, as in \"data.path='/tmp/données.txt'\""),
    (("eval.every=2", "eval.sample_prompt=abcd", "eval.sample_tokens=40"),  # 32 positions
     "eval.sample_prompt (4 tokens) and eval.sample_tokens=40 need 44 positions but the model "
     "has 32: set eval.sample_tokens <= 28"),
])
def test_a_key_hydra_would_add_or_an_empty_folder_is_one_line(monkeypatch, tmp_path, args,
                                                              message):
    code, err = _cli_in_this_process(monkeypatch, tmp_path, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), err


def test_clamp_warmup_says_it_in_one_line():
    from framework.run.checks import clamp_warmup
    from tools.recipe import compose

    cfg = compose(["recipe=llama_tiny_debug", "optim.warmup_steps=7"])
    clamped, warning = clamp_warmup(cfg)
    assert clamped.optim.warmup_steps == cfg.train.steps == 6
    assert warning.startswith("warning: optim.warmup_steps=7 is more than train.steps=6")
    assert "\n" not in warning and clamp_warmup(clamped) == (clamped, None)


def test_metrics_deleted_or_cut_short_under_the_run_are_written_anew(tmp_path, capsys):
    from framework.run.tracking import JsonlSink, read_metrics

    sink = JsonlSink(tmp_path)
    sink.log(1, {"train/loss": 2.0})
    sink.log(2, {"train/loss": 1.5})
    (tmp_path / "metrics.jsonl").unlink()
    sink.log(3, {"train/loss": 1.0})
    (tmp_path / "metrics.jsonl").write_text("")
    sink.log(4, {"train/loss": 0.5})
    sink.finish({})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "was deleted under the run before step 3" in lines[0]
    assert "was cut short under the run before step 4" in lines[1]


def test_summary_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    import json

    from framework.run import tracking

    tracking.write_summary(tmp_path, {"status": "running", "step": 1})
    monkeypatch.setattr(tracking.json, "dumps", lambda *a, **k: (_ for _ in ()).throw(
        OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        tracking.write_summary(tmp_path, {"status": "failed"})
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_wandb_online_without_a_login_is_one_line_before_jax_starts(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    code, err = _cli_in_this_process(monkeypatch, tmp_path, "logging=wandb_online")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: logging.wandb.mode=online needs a W&B login")


def test_config_json_with_a_non_integer_size_is_one_line():
    from framework.errors import ConfigError
    from framework.io.hf import llama as hf

    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32.5,
              "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    with pytest.raises(ConfigError, match=r"config.json: hidden_size=32.5 is not a whole "
                                          r"number >= 1"):
        hf.model_config(config)
    with pytest.raises(ConfigError, match="rms_norm_eps='x' is not a number > 0"):
        hf.model_config({**config, "hidden_size": 32, "rms_norm_eps": "x"})


def test_imported_weights_with_nan_are_one_line_before_compiling(monkeypatch):
    from framework.errors import ConfigError
    import jax
    import numpy as np

    from framework.io.hf import llama as hf
    from tests.helpers import FIXTURES

    folder = FIXTURES / "hf" / "untied_gqa"
    cfg = hf.model_config(hf.read_config(folder))
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                             hf.canonical_shapes(cfg))
    read = hf.read_shards

    def poisoned(*args):
        blocks = read(*args)
        return {d: np.full_like(b, np.nan) for d, b in blocks.items()}

    monkeypatch.setattr(hf, "read_shards", poisoned)
    with pytest.raises(ConfigError, match="hold NaN or Inf values"):
        hf.load_params(folder, cfg, shardings)


def test_ctrl_c_in_a_sweep_says_the_sweep_stops_not_that_nothing_started():
    code = ("import os, signal, time; from framework.runtime import faults; "
            "faults.install_early_handlers(); faults.sweep_started(); "
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(5)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 130
    assert proc.stderr.strip().splitlines() == [
        "error: interrupted: the sweep stops: the job in progress ends on its own (its "
        "folder's summary.json says how), the jobs after it do not start"]


def test_a_lock_folder_that_is_a_file_is_named_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    for folder in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(errors.ConfigError, match=f"{tmp_path / 'afile'} is a file, not a folder"):
            runlock.acquire(folder)


def test_a_signal_during_an_import_still_ends_in_one_line():
    """The early handlers' message, with the module that knows the terminal only partly
    imported (the signal arrived while the main thread imported it): the line and the
    status, not an ImportError from the handler (CI, 2026-12-01: Ctrl-C in the first
    instant gave a traceback and exit 1)."""
    code = ("import sys, types\n"
            "sys.modules['framework.runtime.quiet'] = types.ModuleType('partly made')\n"
            "from framework.runtime import faults\n"
            "faults._say_and_exit('error: interrupted', faults.INTERRUPTED_EXIT)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stderr, done.stdout) == (130, "error: interrupted\n", "")
