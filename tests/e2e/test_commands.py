"""The other command lines: one-line refusals of `python -m framework.run` that stop
before a run starts, `python -m framework.generate`, and the tools that print or draw
what a compiled or profiled step did."""

import jax
import numpy as np
import pytest

from framework.analysis import profiling
from framework.config import ParallelConfig
from framework.engine import decode
from framework.io.hf import llama as hf
from framework.parallel.mesh import make_mesh
from framework.parallel.pipeline.schedule import make_schedule
from tests import cli
from tests.helpers import FIXTURES, engine, params, tokens


def test_a_run_predicted_not_to_fit_exits_2_before_allocating(tmp_path, env):
    run_dir = tmp_path / "run"
    proc = cli.train(run_dir, "recipe=llama_tiny_debug", "logging=no_wandb",
                     "devices.memory_limit_gb=0.0001", env=env)
    assert cli.one_error_line(proc).startswith("the run needs")
    assert "mesh pipe=" not in proc.stdout  # stopped before the engine and the start line
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()


def test_an_output_folder_that_cannot_be_created_is_one_line_and_exit_2(tmp_path, env):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = cli.framework("run", "recipe=llama_tiny_debug", f"hydra.run.dir={blocker / 'run'}",
                         cwd=tmp_path, env=env)
    assert cli.one_error_line(proc) == (
        f"cannot create the output folder {blocker / 'run'}: Not a directory: set "
        f"hydra.run.dir (or hydra.sweep.dir) to a folder that can be written")


def test_generate_on_a_hf_folder_with_tensor_parallelism(env):
    """Greedy decoding through the command line at tensor=2 against the naive reference
    (the full forward recomputed for every token) on one device."""
    folder = FIXTURES / "hf" / "llama3_bf16_sharded"
    cfg = hf.model_config(hf.read_config(folder))
    prompt = np.load(folder / "ids.npy")[:1, :4]
    dec = decode.Decoder(cfg, make_mesh(ParallelConfig(), jax.devices()[:1]))
    want = decode.greedy_by_recompute(cfg, hf.load_params(folder, cfg, dec.param_shardings),
                                      prompt, 32)
    proc = cli.ok(cli.framework(
        "generate", f"checkpoint={folder}", "prompt_ids=" + ",".join(map(str, prompt[0])),
        "max_new_tokens=32", "temperature=0", "tensor=2", "print_ids=true",
        "stop_at_eos=false", "platform=cpu", cwd=cli.REPO, env=env))
    assert f"ids: {want[0].tolist()}" in proc.stdout
    assert "tensor=2" in proc.stderr and "tokens/s" in proc.stderr


def test_export_into_a_run_folder_and_a_seed_beyond_uint32_are_one_line_errors(tmp_path, env):
    """The command lines' exit 2 and one line (the rules themselves:
    tests/unit/test_export_folder.py, tests/parity/test_generate.py). The export wrote
    into the run folder before, and the seed was an OverflowError traceback."""
    folder = FIXTURES / "hf" / "untied_gqa"
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "summary.json").write_text("{}")
    proc = cli.tool("export_hf", str(folder), str(run_dir), "--overwrite", env=env)
    assert cli.one_error_line(proc).startswith(f"the output folder {run_dir} is a run folder")
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "summary.json"]
    proc = cli.framework("generate", f"checkpoint={folder}", "prompt_ids=1", "seed=4294967296",
                         cwd=tmp_path, env=env)
    assert cli.one_error_line(proc) == "seed=4294967296 must be in [0, 4294967295] (a uint32)"


def test_comm_audit_command_line_lists_collectives_and_axes(env):
    proc = cli.ok(cli.tool("comm_audit", "recipe=llama_tiny_debug", env=env))
    lines = proc.stdout.splitlines()
    assert any(line.startswith("collective-permute") and " pipe " in line for line in lines)
    axes = {line.split()[0]: line.split() for line in lines if line.split()[:1] in
            (["pipe"], ["data"], ["tensor"])}
    assert set(axes) == {"pipe", "data", "tensor"}
    for axis, (_, measured, expected, ratio) in axes.items():
        assert float(measured.replace(",", "")) > 0 and float(ratio) >= 0.99, axis
    bad = cli.tool("comm_audit", "recipe=llama_tiny_debug", "parallel.pipeline=3", env=env)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1


def test_schedule_plot_draws_a_runs_trace(tmp_path, env):
    """The timeline a profiled run leaves, drawn beside its table."""
    eng = engine(2, 1, 1, 4, schedule="zb_h1")
    box = {"state": eng.init_state(params())}
    batch = eng.shard_batch(tokens(0))
    eng.compile(box["state"], batch)

    def two():
        for _ in range(2):
            box["state"], metrics = eng.step(box["state"], batch)
        jax.block_until_ready(metrics)

    two()
    found = profiling.measure(eng, two, tmp_path)
    assert 0 < found["pipeline/bubble_fraction_timed"] < 1
    out = tmp_path / "trace.png"
    proc = cli.ok(cli.tool("schedule_plot", "--trace", str(tmp_path), "-o", str(out), env=env))
    assert out.read_bytes()[:4] == b"\x89PNG" and "bubble measured" in proc.stdout
    assert make_schedule("zb_h1", 2, 4).bubble_fraction == pytest.approx(1 / 13)
