"""Issue 46 as a user meets it, in subprocesses: the reproductions whose point is the
process itself (a hang, a plugin's start-up on stderr, a traceback before the run
starts) end in their exit status and exactly one stderr line."""

import glob
import importlib.util

import pytest

from tests import cli
from tests.helpers import FIXTURES


def lines(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


def test_1_2_14_the_tools_verbatim(tmp_path, env):
    x = tmp_path / "x.bin"
    x.write_bytes(b"hello world\n")
    proc = cli.tool("prepare_data", str(x), str(x), env=env, timeout=60)
    assert proc.returncode == 2 and len(lines(proc)) == 1 and x.read_bytes() == b"hello world\n"
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"text": "mine"}\n')
    proc = cli.tool("train_tokenizer", str(notes), str(notes), env=env, timeout=60)
    assert proc.returncode == 2 and len(lines(proc)) == 1
    assert notes.read_text() == '{"text": "mine"}\n'
    bad = tmp_path / "bad.jsonl"  # the hang: a worker's error swallowed by the pool
    bad.write_text('{"text": "ok"}\n{"body": 1}\n')
    proc = cli.tool("prepare_data", str(tmp_path / "c"), str(notes), str(bad),
                    "--processes", "2", env=env, timeout=60)
    assert proc.returncode == 2 and lines(proc) == [
        f"error: {bad}:2: no 'text' field (--text-field names the field that holds the text)"]


def test_4_a_compile_into_a_training_runs_folder_is_refused(tmp_path, env):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "summary.json").write_text('{"status": "running", "step": 40}\n')
    (run / "metrics.jsonl").write_text('{"step": 40}\n')
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    proc = cli.framework("compile", "recipe=llama_tiny_debug", f"hydra.run.dir={run}",
                         cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 2 and len(lines(proc)) == 1
    assert "is a training run's folder" in proc.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()
            and p.name != "run.log"} == before  # Hydra's own log aside


def test_16_an_export_prints_only_its_own_line(tmp_path, env):
    proc = cli.ok(cli.tool("export_hf", str(FIXTURES / "hf" / "tied_gqa"),
                           str(tmp_path / "out"), env=env, timeout=120))
    assert len(lines(proc)) == 1 and lines(proc)[0].startswith("wrote config.json")


NO_GPU_WITH_CUDA_PLUGIN = (importlib.util.find_spec("jax_plugins") is not None
                           and not glob.glob("/dev/nvidia[0-9]*"))


@pytest.mark.skipif(not NO_GPU_WITH_CUDA_PLUGIN, reason="needs the CUDA plugin and no GPU")
def test_15_gpu_asked_for_without_one_is_one_line(tmp_path, env):
    proc = cli.framework("run", "recipe=llama_tiny_debug", "devices.platform=gpu",
                         f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=env,
                         timeout=120)
    assert proc.returncode == 2 and len(lines(proc)) == 1, proc.stderr[-2000:]
    assert "devices.platform=gpu is not available here (JAX finds no GPU" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_refused_setting_leaves_no_run_folder(tmp_path, env):
    """The front door: Hydra creates outputs/<date>/<time>/ before the settings are
    checked; a refused run removes it (and the empty outputs/ above it)."""
    proc = cli.framework("run", "recipe=llama_tiny_debug", "parallel.pipeline=3",
                         cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 2 and len(lines(proc)) == 1
    assert not (tmp_path / "outputs").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    proc = cli.framework("run", "recipe=llama_tiny_debug", "parallel.pipeline=3",
                         f"hydra.run.dir={tmp_path / 'mine'}", cwd=tmp_path, env=env,
                         timeout=120)
    assert proc.returncode == 2 and (tmp_path / "mine" / "notes.txt").read_text() == "kept"
