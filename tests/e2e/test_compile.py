"""`python -m framework.compile` as a user runs it: the report on stdout and in
compile_report.json, sweeps, and a program too big for its target in one line."""

import importlib.util
import json

import pytest

from tests import cli
from tests.compiled.test_aot import BIG

HAVE_AOT = all(importlib.util.find_spec(m) for m in ("libtpu", "jax_plugins"))
pytestmark = pytest.mark.skipif(not HAVE_AOT, reason="needs pip install -e '.[aot]'")

KEYS = ["memory/compiled_bytes_per_device", "memory/predicted_bytes_per_device",
        "memory/device_bytes", "fits", "compile_time_s", "comm/bytes_per_step/pipe",
        "comm/bytes_per_step/data", "comm/bytes_per_step/tensor"]
OVERLAP = [f"comm/overlapped_fraction/{a}" for a in ("pipe", "data", "tensor")]


@pytest.mark.parametrize("target", ["gpu:h100x8", "tpu:v5p-16"])
def test_too_big_for_the_target_is_exit_2_and_one_line(target, tmp_path, env):
    proc = cli.framework("compile", "recipe=llama_tiny_debug", f"target={target}", *BIG[target[:3]],
                         f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=env)
    line = cli.one_error_line(proc)
    assert line.startswith(f"{target}: the compiled step needs ") and " GiB" in line
    assert "predicted to fit: " in line
    assert cli.summary(tmp_path / "run")["status"] == "does_not_fit"


def test_a_wrong_target_is_one_line(tmp_path, env):
    proc = cli.framework("compile", "recipe=llama_tiny_debug", "target=gpu:h100x12",
                         f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=env)
    assert "a multiple of 8" in cli.one_error_line(proc)


def test_a_sweep_over_targets_prints_and_writes_each_report(tmp_path, env):
    """One job per target (a process each), as training sweeps do: each job prints its
    report and writes compile_report.json with the issue's keys; nothing on stderr (the
    compilers' own logging goes to compile.log)."""
    proc = cli.ok(cli.framework("compile", "-m", "recipe=llama_tiny_debug",
                                "target=gpu:h100x8,tpu:v5p-16", "parallel.schedule=1f1b",
                                f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, env=env))
    assert proc.stderr == ""
    jobs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(jobs) == 2 and proc.stdout.count("GiB per device (compiled)") == 0
    assert proc.stdout.count("MiB per device (compiled)") == 2  # tiny programs
    for target in ("gpu:h100x8", "tpu:v5p-16"):
        assert f"{target}: 8 x " in proc.stdout
    for job in jobs:
        report = json.loads((job / "compile_report.json").read_text())
        keys = KEYS + (OVERLAP if report["target"].startswith("gpu") else [])
        assert [k for k in keys if k not in report] == []
        assert report["fits"] is True and report["memory/compiled_bytes_per_device"] > 0
        assert cli.summary(job)["status"] == "compiled"


def test_a_sweep_with_a_job_that_does_not_compile_exits_non_zero(tmp_path, env):
    """Every job still runs; the sweep's last line names the one that did not compile."""
    proc = cli.framework("compile", "-m", "recipe=llama_tiny_debug",
                         "target=local,gpu:h100x12", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                         cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.count("per device (compiled)") == 1  # the local job compiled
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 1 compile job(s) did not compile:") and "multiple of 8" in last
