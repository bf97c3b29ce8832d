"""The pieces behind the command line, without starting a run: device counts, job
names, FLOPs and peaks, the progress line, one-line errors."""

from __future__ import annotations

import io
import json

import pytest
from omegaconf import OmegaConf

from framework import devices, flops, sweep, tracking
from framework.config import ConfigError, DevicesConfig, ModelConfig, ParallelConfig
from framework.run import _job_dirname, one_line


@pytest.mark.parametrize("degrees,local,expected", [
    ((2, 2, 2), None, 8),  # exactly the devices the degrees need
    ((1, 1, 2), None, 2),
    ((2, -1, 1), None, 8),  # data fills the default pool of 8
    ((4, -1, 4), None, 16),  # ... or pipeline * tensor if that is larger
    ((1, -1, 1), 4, 4),  # devices.local_device_count wins
])
def test_simulated_device_count(degrees, local, expected):
    par = ParallelConfig(pipeline=degrees[0], data=degrees[1], tensor=degrees[2])
    assert devices.simulated_count(DevicesConfig(local_device_count=local), par) == expected


def test_planned_count_on_cpu_needs_no_backend():
    par = ParallelConfig(pipeline=2, data=-1, tensor=2)
    assert devices.planned_count(DevicesConfig(platform="cpu"), par) == 8
    with pytest.raises(ConfigError, match="local_device_count"):
        devices.simulated_count(DevicesConfig(local_device_count=0), par)


def test_job_names_come_from_degrees_and_other_swept_settings():
    task = ["recipe=llama_small_3d", "parallel.pipeline=2", "optim.lr=0.01", "train.steps=5"]
    assert sweep.job_name("pp2-dp2-tp2-mb8", task, {"parallel.pipeline"}) == "pp2-dp2-tp2-mb8"
    assert (sweep.job_name("pp2-dp2-tp2-mb8", task, {"parallel.pipeline", "optim.lr"})
            == "pp2-dp2-tp2-mb8_optim.lr=0.01")
    assert sweep.quote("/a/b=c,d") == "'/a/b=c,d'"


def test_sweep_job_folder_resolves_data_fill_without_starting_jax(monkeypatch):
    monkeypatch.setattr("sys.argv", ["run", "-m", "parallel.pipeline=1,2", "optim.lr=1e-3,1e-2"])
    root = OmegaConf.create({
        "parallel": {"pipeline": 2, "data": -1, "tensor": 1, "microbatches": 4},
        "devices": {"platform": "cpu", "local_device_count": None},
        "hydra": {"job": {"num": 3},
                  "overrides": {"task": ["parallel.pipeline=2", "optim.lr=1e-2"]}}})
    assert _job_dirname(_root_=root) == "pp2-dp4-tp1-mb4_optim.lr=1e-2"
    root.parallel.pipeline = "oops"  # never breaks the sweep over a folder name
    assert _job_dirname(_root_=root) == "job3"


def test_flops_per_token_counts_matmul_params_and_attention():
    m = ModelConfig(vocab_size=100, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16)
    # per layer: q,o 8x8 each; k,v 8x4 each; gate, up, down 8x16 each; 2 norms of 8
    layer = 2 * 64 + 2 * 32 + 3 * 128 + 2 * 8
    n = 2 * layer + 8 + 8 * 100  # layers + final norm + LM head (embedding excluded)
    assert flops.matmul_params(m) == n
    assert flops.flops_per_token(m, seq_len=10) == 6 * n + 12 * 2 * 8 * 10


def test_peak_table_and_mfu():
    assert flops.peak_flops_per_device("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert flops.peak_flops_per_device("NVIDIA H200", "float32") == 494.7e12
    assert flops.peak_flops_per_device("TPU v5 lite", "bfloat16") == 197e12
    assert flops.peak_flops_per_device("cpu", "float32") is None
    perf = flops.throughput(1000.0, 4, 1e9, 1e12)
    assert perf["perf/tflops_per_device"] == pytest.approx(0.25)
    assert perf["perf/mfu"] == pytest.approx(0.25)
    assert flops.throughput(1000.0, 4, 1e9, None)["perf/mfu"] is None


def test_progress_line_and_jsonl_without_a_terminal(tmp_path):
    out = io.StringIO()
    bar = tracking.ProgressBar(total=20, stream=out)
    tracker = tracking.Tracker(tmp_path, [tracking.JsonlSink(tmp_path), bar], {"mesh_name": "x"})
    tracker.update(3)  # not a terminal: nothing drawn between logs
    tracker.log(10, {"train/loss": 2.5, "perf/tokens_per_sec": 1234.0, "perf/mfu": None})
    summary = tracker.finish("completed")
    assert out.getvalue().count("\n") == 1
    assert "step 10/20" in out.getvalue() and "loss 2.5000" in out.getvalue()
    assert "1,234 tok/s" in out.getvalue()
    line = json.loads((tmp_path / tracking.METRICS_FILE).read_text())
    assert line == {"step": 10, "train/loss": 2.5, "perf/tokens_per_sec": 1234.0,
                    "perf/mfu": None}
    assert json.loads((tmp_path / tracking.SUMMARY_FILE).read_text()) == summary
    assert summary["status"] == "completed" and summary["train/loss"] == 2.5


def test_one_line_error_messages():
    err = ConfigError("model.n_layers=4 is not divisible by parallel.pipeline=3")
    assert one_line(err) == str(err)
    try:
        raise RuntimeError("Could not override 'x.y'.\nTo append use +x.y") from KeyError("k")
    except RuntimeError as chained:
        assert one_line(chained) == "Could not override 'x.y': 'k'"
