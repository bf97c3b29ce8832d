"""The command line, as a user runs it: `python -m framework.run ...` in a subprocess,
from a working directory outside the repository (recipes must still be found)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework.config import RunConfig
from framework.engine.validate import validate
from framework.parallel.pipeline.schedule import make_schedule
from framework.run.checks import check_run
from framework.run.tracking import read_metrics

from tests import cli
from tests.cli import REPO
from tests.helpers import compose_recipe, load_tool

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
TINY_STEPS, TINY_EVERY = 6, 2  # recipes/llama_tiny_debug.yaml


def framework_run(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return cli.framework("run", *args, cwd=cwd, env=env)


def wandb_records(run_dir: Path) -> list[dict]:
    """The offline W&B run file read back with W&B's own reader (`wandb leet inspect`)."""
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                          str(files[0])], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_composes_and_validates(name):
    cfg = compose_recipe(name)
    assert isinstance(cfg, RunConfig)
    check_run(cfg)
    n_devices = cfg.parallel.n_devices if cfg.parallel.data != -1 else 8
    parallel = validate(cfg.model, cfg.parallel, cfg.train, n_devices)
    bubble = make_schedule(parallel.schedule, parallel.pipeline, parallel.microbatches,
                           parallel.virtual_stages).formula_bubble
    assert bubble <= 0.34, (name, bubble)
    if cfg.devices.platform in ("gpu", "tpu") and parallel.pipeline > 1:
        # A tick schedule: GPipe and circular keep every microbatch's stash alive
        # (llama_1b_8gpu shipped GPipe until 2026-11-30: 19.55 GiB against 1F1B's 10.45).
        assert parallel.schedule not in ("gpipe", "circular"), (name, parallel.schedule)


def test_recipes_have_their_promised_shapes():
    small = compose_recipe("llama_small_3d")
    assert (small.parallel.pipeline, small.parallel.data, small.parallel.tensor) == (2, 2, 2)
    assert (small.parallel.pipeline - 1) / (small.parallel.microbatches
                                            + small.parallel.pipeline - 1) <= 0.30
    node = compose_recipe("llama_1b_8gpu")
    assert node.parallel.n_devices == 8 and node.devices.platform == "gpu"
    assert compose_recipe("llama_tiny_debug", "train.steps=3").train.steps == 3


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, env):
    cwd = tmp_path_factory.mktemp("elsewhere")
    run_dir = cwd / "run"
    # A warm-up longer than the run (a short trial of a recipe): clamped with one warning.
    proc = framework_run("recipe=llama_tiny_debug", "optim.warmup_steps=50",
                         "logging.tensorboard=true", f"hydra.run.dir={run_dir}", cwd=cwd,
                         env=env)
    return proc, run_dir


def test_tiny_run_writes_metrics_summary_and_offline_wandb(tiny_run):
    proc, run_dir = tiny_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "warning: optim.warmup_steps=50 is more than train.steps=6: the learning rate "
        "warms up over all 6 steps (it reaches optim.lr at the last)"]
    assert "mesh pipe=2 data=2 tensor=2 on 8 cpu devices (simulated)" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(TINY_EVERY, TINY_STEPS + 1, TINY_EVERY))
    for key in ("train/loss", "train/grad_norm", "train/lr", "perf/step_time_s",
                "perf/tokens_per_sec", "perf/tokens_per_sec_per_device",
                "perf/tflops_per_device", "perf/mfu", "pipeline/bubble_fraction",
                "pipeline/bubble_fraction_table", "memory/peak_bytes_per_device",
                "memory/temp_bytes_per_device", "comm/bytes_per_step/pipe",
                "comm/bytes_per_step/data", "comm/bytes_per_step/tensor"):
        assert all(key in r for r in records), key
    assert all(records[-1][f"comm/bytes_per_step/{a}"] > 0 for a in ("pipe", "data", "tensor"))
    assert records[-1]["perf/tokens_per_sec"] > 0 and records[-1]["perf/mfu"] is None
    assert records[0]["perf/compile_time_s"] > 0
    assert "perf/compile_time_s" not in records[1]  # reported once
    assert abs(records[-1]["pipeline/bubble_fraction"] - 1 / 3) < 1e-9  # pp=2, mb=2

    # The bubble timed on the devices' own timeline (profile.steps=2 from step 3).
    assert records[1]["perf/tokens_per_sec"] is None  # profiled steps are not timed
    assert 0 < records[-1]["pipeline/bubble_fraction_timed"] < 1
    timeline = json.loads((run_dir / "profile" / "timeline.json").read_text())
    assert len(timeline["steps"]) == 2 and len(timeline["steps"][0]["ranks"]) == 2
    assert {k for rank in timeline["steps"][0]["ranks"] for _, _, k in rank} == {"F", "BW"}

    # TensorBoard: the same records (logging.tensorboard=true)
    from tests.unit.test_tensorboard import read_events, scalars

    board = scalars(read_events(run_dir / "tensorboard"))
    assert [s for s, _ in board["train/loss"]] == [r["step"] for r in records]
    assert abs(board["train/loss"][-1][1] - records[-1]["train/loss"]) < 1e-5

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert len(summary["pipeline/bubble_fraction_timed_per_rank"]) == 2
    assert summary["parallel"]["pipeline"] == summary["parallel"]["data"] == 2
    assert summary["train/loss"] == records[-1]["train/loss"]
    assert summary["memory/peak_bytes_per_device"] > 0
    assert summary["memory/temp_bytes_per_device"] > 0


def test_offline_wandb_history_read_back_from_the_run_file(tiny_run):
    proc, run_dir = tiny_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = wandb_records(run_dir)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert len(history) == TINY_STEPS // TINY_EVERY
    assert all("pipeline/bubble_fraction" in h for h in history)
    # Steps 3-4 are profiled (profile.start_step=3): no throughput in that window.
    assert "perf/tokens_per_sec" in history[-1] and "pipeline/bubble_fraction_timed" in history[-1]
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["display_name"] == "pp2-dp2-tp2-mb2"
    assert run["config"]["update"]["parallel"]["tensor"] == 2  # the resolved config


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory, env):
    """pipeline=1,2,3 on a 4-layer model with data=tensor=1: jobs need 1 and 2 devices,
    and pipeline=3 is invalid (4 layers do not split into 3 stages)."""
    cwd = tmp_path_factory.mktemp("sweep_cwd")
    folder = cwd / "sweep"
    proc = framework_run("-m", "recipe=llama_tiny_debug", "parallel.pipeline=1,2,3",
                         "parallel.data=1", "parallel.tensor=1", "train.steps=2",
                         "logging.progress=false", f"hydra.sweep.dir={folder}", cwd=cwd,
                         env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


def test_multirun_runs_jobs_with_different_device_counts_and_skips_invalid(sweep_dir):
    ok = {n: json.loads((sweep_dir / n / "summary.json").read_text())
          for n in ("pp1-dp1-tp1-mb2", "pp2-dp1-tp1-mb2")}
    assert [s["status"] for s in ok.values()] == ["completed", "completed"]
    assert [s["n_devices"] for s in ok.values()] == [1, 2]
    skipped = json.loads((sweep_dir / "pp3-dp1-tp1-mb2" / "summary.json").read_text())
    assert skipped["status"] == "skipped"
    assert "model.n_layers=4 is not divisible by parallel.pipeline=3" in skipped["reason"]
    groups = {next(r["run"]["run_group"] for r in wandb_records(sweep_dir / n)
                   if r["type"] == "run") for n in ok}
    assert groups == {sweep_dir.name}  # one W&B group for the whole sweep


def test_sweep_report_writes_table_and_chart(sweep_dir, tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "sweep_report.py"),
                           str(sweep_dir), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    table = (tmp_path / "sweep_report.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| pp")]
    assert len(rows) == 3
    assert "| 2 | 1 | 1 | 1 | 2 |" in table and "skipped: model.n_layers" in table
    png = (tmp_path / "sweep_report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


@pytest.mark.parametrize("args,expected", [
    (["recipe=no_such_recipe"], "Could not find 'recipe/no_such_recipe'"),
    (["recipe=llama_tiny_debug", "paralel.pipeline=2"], "Key 'paralel' not in 'RunConfig'"),
    (["recipe=llama_tiny_debug", "train.steps=many"], "train.steps=many"),
    (["recipe=llama_tiny_debug", "parallel.pipeline=3"], "parallel.pipeline=3"),
    (["recipe=llama_tiny_debug", "distributed.num_processes=2"],
     "distributed.num_processes=2 needs distributed.coordinator_address"),
    (["recipe=llama_small_3d", "parallel.stage_layers=4"],  # not a list: no Hydra line
     "parallel.stage_layers=4 is a number, not a list: it takes a list of positive whole "
     "numbers, the layers of each global stage (e.g. [2,2]), or auto, or null"),
], ids=["unknown-recipe", "misspelled-key", "wrong-type", "invalid-degree", "half-multi-host",
        "stage-layers-not-a-list"])
def test_user_errors_exit_nonzero_with_one_line(args, expected, tmp_path, env):
    proc = framework_run(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr and "mesh pipe=" not in proc.stdout  # no compile
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cfg_job_prints_the_resolved_config(tmp_path, env):
    proc = framework_run("recipe=llama_small_3d", "parallel.microbatches=16", "--cfg", "job",
                         cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    printed = OmegaConf.create(proc.stdout)
    assert printed.parallel.microbatches == 16 and printed.model.d_model == 256


def test_generate_help_lists_its_settings(tmp_path, env):
    proc = cli.ok(cli.framework("generate", "--help", cwd=tmp_path, env=env))
    assert "checkpoint=None" in proc.stdout and "temperature=0.8" in proc.stdout


def test_a_run_on_a_prepared_corpus_logs_its_named_validation_set(tmp_path, env):
    """tools/prepare_data.py <folder>, then data=corpus with eval.sets and document masks
    (each line a document: byte 10 ends them): the named set's loss in every
    evaluation's record; a damaged shard: one line, exit 2, nothing run."""
    text = "".join(f"line {i} of a small corpus for this test.\n" for i in range(4000))
    (tmp_path / "a.txt").write_text(text[: len(text) // 2])
    (tmp_path / "b.txt").write_text(text[len(text) // 2:])
    prepare = load_tool("prepare_data").main
    prepare([str(tmp_path / "c"), str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
             "--processes", "2", "--shard-tokens", "20000", "--eos-id", "10"])
    prepare([str(tmp_path / "v"), str(tmp_path / "b.txt"), "--processes", "1", "--eos-id", "10"])
    args = ("recipe=llama_tiny_debug", "train.steps=4", "eval.every=2", "logging=no_wandb",
            "profile.steps=0", "data=corpus", f"data.path={tmp_path / 'c'}",
            f"eval.sets={{held: {tmp_path / 'v'}}}", "data.document_mask=true",
            "data.reset_positions=true")
    proc = framework_run(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run") if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0 < r["eval/held/loss"] < 10 for r in evals)
    shard = next((tmp_path / "c").glob("shard-*.bin"))
    shard.write_bytes(shard.read_bytes()[:-4])
    proc = framework_run(*args, f"hydra.run.dir={tmp_path / 'run2'}", cwd=tmp_path, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "is truncated" in lines[0], proc.stderr


def test_a_corpus_run_resumed_mid_epoch_on_another_mesh_sees_the_same_batches(tmp_path, env):
    """20 sequences of 32 tokens, 8 a step: an epoch is 2.5 steps. Stopped at step 3
    (mid-epoch) on (2, 2, 2) and resumed on (1, 4, 2): the losses of an uninterrupted
    run on (2, 2, 2), to float rounding (another batch would be far off)."""
    text = "".join(f"{i} fine words make a corpus.\n" for i in range(30))[:20 * 32 + 1]
    (tmp_path / "a.txt").write_text(text)
    load_tool("prepare_data").build([str(tmp_path / "c"), str(tmp_path / "a.txt"),
                                    "--processes", "1"])
    args = ("recipe=llama_tiny_debug", "train.steps=6", "logging.every=1", "logging=no_wandb",
            "profile.steps=0", "eval.every=0", "data=corpus", "data.holdout_fraction=0",
            f"data.path={tmp_path / 'c'}")
    run = lambda name, *more: framework_run(*args, *more, f"hydra.run.dir={tmp_path / name}",
                                            cwd=tmp_path, env=env)
    for proc in (run("full"), run("part", "train.stop_at=3"),
                 run("part", "parallel.pipeline=1", "parallel.data=4")):
        assert proc.returncode == 0, proc.stderr[-3000:]
    loss = lambda name: {r["step"]: r["train/loss"] for r in read_metrics(tmp_path / name)}
    full, part = loss("full"), loss("part")
    assert sorted(part) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(part[step] - full[step]) <= 1e-5 * full[step], (step, part, full)
