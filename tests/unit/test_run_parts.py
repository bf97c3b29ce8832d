"""The pieces behind the command line, without starting a run: device counts, job
names, FLOPs and peaks, the progress line, one-line errors, the multi-host plan, the
loop's handling of NaNs, hooks and SIGTERM, metrics.jsonl of a resumed run."""

from __future__ import annotations

import io
import json
import os
import signal

import jax.numpy as jnp
import pytest
from omegaconf import OmegaConf

from framework import errors
from framework.runtime import devices, distributed, faults
from framework import hardware
from framework.analysis import flops
from framework.model import flops as model_flops
from framework.run import loop, sweep, tracking
from framework.errors import ConfigError
from framework.config import DevicesConfig, DistributedConfig, ModelConfig, ParallelConfig
from framework.run.cli import _job_dirname, one_line


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
    # A launcher running the job in another process (submitit on SLURM): that process's
    # arguments are not the sweep's, so the job number keeps job folders apart.
    monkeypatch.setattr("sys.argv", ["submitit", "/sweep/.submitit/42"])
    assert _job_dirname(_root_=root) == "pp2-dp4-tp1-mb4_job3"
    root.parallel.pipeline = 3  # 8 devices cannot be filled around 3 stages: skipped
    assert _job_dirname(_root_=root) == "pp3-dpfill-tp1-mb4_job3"  # never "dp-1"
    root.parallel.pipeline = "oops"  # never breaks the sweep over a folder name
    assert _job_dirname(_root_=root) == "job3"


def test_flops_per_token_counts_matmul_params_and_attention():
    m = ModelConfig(vocab_size=100, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16)
    # per layer: q,o 8x8 each; k,v 8x4 each; gate, up, down 8x16 each; 2 norms of 8
    layer = 2 * 64 + 2 * 32 + 3 * 128 + 2 * 8
    n = 2 * layer + 8 + 8 * 100  # layers + final norm + LM head (embedding excluded)
    assert model_flops.matmul_params(m) == n
    assert model_flops.model_flops_per_token(m, seq_len=10) == 6 * n + 12 * 2 * 8 * 10


def test_peak_table_and_mfu():
    assert hardware.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert hardware.peak_flops("NVIDIA H200", "float32") == 494.7e12
    assert hardware.peak_flops("TPU v5 lite", "bfloat16") == 197e12
    assert hardware.peak_flops("cpu", "float32") is None
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


# --- Multi-host plan, the loop's faults and stops, metrics.jsonl on resume -------------

SLURM_4 = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "4",
           "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "n[1-2]"}


def test_distributed_plan_from_settings_and_slurm():
    plan = distributed.plan
    assert plan(DistributedConfig(), {}) is None  # one process
    assert plan(DistributedConfig(), {**SLURM_4, "SLURM_NTASKS": "1",
                                      "SLURM_STEP_NUM_TASKS": "1"}) is None
    batch_script = {k: v for k, v in SLURM_4.items() if not k.startswith("SLURM_STEP")}
    assert plan(DistributedConfig(), {**batch_script, "SLURM_PROCID": "0"}) is None
    slurm = plan(DistributedConfig(), SLURM_4)  # srun -n 4: JAX reads SLURM's variables
    assert slurm == distributed.Plan(None, None, None, "slurm")
    assert distributed.expected_processes(slurm, SLURM_4) == 4
    assert plan(DistributedConfig(num_processes=1), SLURM_4) is None  # opt out
    assert plan(DistributedConfig(num_processes=-1), {}).source == "detect"
    explicit = plan(DistributedConfig("127.0.0.1:1234", 2, 1), {})
    assert explicit == distributed.Plan("127.0.0.1:1234", 2, 1, "config")
    assert distributed.expected_processes(explicit) == 2
    with pytest.raises(ConfigError, match="distributed.coordinator_address and "
                                          "distributed.process_id"):
        plan(DistributedConfig(num_processes=2), {})
    with pytest.raises(ConfigError, match=r"distributed.heartbeat_timeout_s=0 must be >= 1"):
        plan(DistributedConfig(num_processes=2, heartbeat_timeout_s=0), {})
    assert plan(DistributedConfig("h:1", 2, 0, heartbeat_timeout_s=7), {}).heartbeat_timeout_s == 7
    with pytest.raises(ConfigError, match=r"process_id=2 must be in 0\.\.1"):
        plan(DistributedConfig("127.0.0.1:1234", 2, 2), {})
    with pytest.raises(ConfigError, match="host:port"):
        plan(DistributedConfig("localhost", 2, 0), {})
    with pytest.raises(ConfigError, match="num_processes is not"):
        plan(DistributedConfig(process_id=0), {})


def test_simulated_devices_are_split_among_processes():
    par = ParallelConfig(pipeline=2, data=2, tensor=2)
    assert devices.simulated_count(DevicesConfig(), par, 2) == 4
    assert devices.simulated_count(DevicesConfig(local_device_count=3), par, 2) == 3
    with pytest.raises(ConfigError, match="devices.local_device_count"):
        devices.simulated_count(DevicesConfig(), par, 3)


class FakeEngine:
    """Steps that return scripted losses; the state is the step count."""

    def __init__(self, losses):
        self.losses = losses

    def shard_batch(self, tokens):
        return tokens

    def step(self, state, tokens):
        return state + 1, {"train/loss": jnp.float32(self.losses[state]),
                           "train/grad_norm": jnp.float32(1.0)}

    def host_metrics(self, metrics):
        return {k: float(v) for k, v in metrics.items()}


class ListLogger:
    def __init__(self):
        self.records = []

    def log(self, step, metrics):
        self.records.append((step, metrics))

    def update(self, step):
        pass


def run_fake(losses, steps, hooks=(), stop=None, log_every=2, start=0):
    logger = ListLogger()
    settings = loop.LoopSettings(steps=steps, log_every=log_every, start=start,
                                 perf=lambda t: {"perf/tokens_per_sec": 1.0 / t})
    result = loop.train_loop(FakeEngine(losses), start, lambda i: i, settings, logger, hooks,
                             stop)
    return result, logger.records


def test_a_nan_loss_stops_the_loop_before_any_hook_sees_its_state():
    saved = []
    hook = loop.Hook("checkpoint", 1, lambda step, state: saved.append(step))
    with pytest.raises(errors.Diverged, match=r"non-finite train/loss at step 4 "
                                              r"\(train/loss=nan, train/grad_norm=1\)"):
        run_fake([3.0, 2.5, 2.0, float("nan"), 1.0, 1.0], 6, (hook,), log_every=10)
    assert saved == [1, 2, 3]  # never step 4


def test_hooks_add_their_metrics_and_results_report_the_steps():
    evals = loop.Hook("eval", 3, lambda step, state: {"eval/loss": 10.0 + step}, at_end=True)
    result, records = run_fake([1.0] * 8, 8, (evals,), start=1)
    assert result.step == 8 and result.state == 8 and result.stopped is None
    assert [s for s, _ in records] == [2, 3, 4, 6, 8]  # log steps and eval steps
    assert {s: r["eval/loss"] for s, r in records if "eval/loss" in r} == {3: 13.0, 6: 16.0,
                                                                            8: 18.0}


def test_a_checkpoint_is_saved_only_after_its_steps_record_is_written():
    logger, seen = ListLogger(), []
    save = loop.Hook("checkpoint", 2, lambda step, state: seen.append(
        (step, [s for s, _ in logger.records])), after_log=True)
    loop.train_loop(FakeEngine([1.0] * 4), 0, lambda i: i,
                    loop.LoopSettings(steps=4, log_every=2,
                                      perf=lambda t: {"perf/tokens_per_sec": 1.0 / t}),
                    logger, (save,))
    assert seen == [(2, [2]), (4, [2, 4])]


def test_sigterm_only_sets_a_flag_and_the_loop_stops_at_the_next_step_boundary():
    before = signal.getsignal(signal.SIGTERM)
    kill = loop.Hook("sigterm", 2, lambda step, state: os.kill(os.getpid(), signal.SIGTERM))
    with faults.StopRequests() as stop:
        result, _ = run_fake([1.0] * 10, 10, (kill,), stop)
    assert (result.step, result.stopped) == (3, "preempted")
    assert signal.getsignal(signal.SIGTERM) == before  # handler restored
    with faults.StopRequests(stop_at=4) as stop:
        assert run_fake([1.0] * 10, 10, stop=stop)[0].stopped == "stopped"
    with faults.StopRequests(stop_at=10) as stop:  # stopping at the end is completing
        assert run_fake([1.0] * 10, 10, stop=stop)[0].stopped is None


def test_a_resumed_run_keeps_metrics_up_to_its_checkpoint_and_appends(tmp_path):
    path = tmp_path / tracking.METRICS_FILE
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n"
                            for s in range(1, 6)) + '{"step": 6, "train/lo')  # cut by a kill
    sink = tracking.JsonlSink(tmp_path, resumed_at=3)
    sink.log(4, {"train/loss": 0.5})
    sink.finish({})
    assert [(r["step"], r["train/loss"]) for r in tracking.read_metrics(tmp_path)] == [
        (1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.5)]
    tracking.JsonlSink(tmp_path).finish({})  # a fresh start empties it
    assert path.read_text() == ""


def test_only_process_0_writes_metrics_summary_and_wandb(tmp_path):
    from framework.run.sinks import make_tracker
    from tests.helpers import compose_recipe

    cfg = compose_recipe("llama_tiny_debug")  # W&B offline by default
    other = make_tracker(cfg, tmp_path, {}, {"run_name": "x"}, primary=False, resumed_at=None,
                         start=0)
    other.log(1, {"train/loss": 1.0})
    other.finish("completed")
    assert other.sinks == [] and list(tmp_path.iterdir()) == []


def test_the_compile_cache_is_used_only_where_it_is_safe():
    """Not with several CPU devices (devices.compile_cache_safe); elsewhere yes."""
    def devset(platform, n):
        return devices.DeviceSet(tuple(range(n)), platform, platform == "cpu", "x")

    assert not devices.compile_cache_safe(devset("cpu", 8))
    assert devices.compile_cache_safe(devset("cpu", 1))
    assert devices.compile_cache_safe(devset("gpu", 8))
    assert devices.compile_cache_safe(devset("tpu", 4))



def test_a_resume_says_when_it_reshards_and_when_the_schedule_length_changed():
    from types import SimpleNamespace

    from framework.config import ParallelConfig, TrainConfig
    from framework.run.start import what_changed

    engine = SimpleNamespace(parallel=ParallelConfig(pipeline=1, data=8, tensor=1))
    same = {"layout": "pp1-dp8-tp1-mb1", "train_steps": 10}
    assert what_changed(same, engine, TrainConfig(steps=10)) == ""
    said = what_changed({"layout": "pp2-dp2-tp2-mb2", "train_steps": 10}, engine,
                        TrainConfig(steps=20))
    assert said == (" (saved on pp2-dp2-tp2-mb2, resharded to pp1-dp8-tp1-mb1; train.steps "
                    "was 10, now 20: the learning-rate schedule spans 20 steps from here on)")
    assert what_changed({}, engine, TrainConfig(steps=20)) == ""  # older checkpoints


def test_a_resume_says_what_the_model_computes_differently_and_the_stored_dtype():
    import dataclasses
    from types import SimpleNamespace

    from framework.config import ModelConfig, ParallelConfig, TrainConfig
    from framework.run.start import what_changed

    import jax

    model = ModelConfig(family="gemma2")
    here = {"params": {"embed": {"table": jax.ShapeDtypeStruct((2, 2), "bfloat16")}}}
    engine = SimpleNamespace(parallel=ParallelConfig(), model=model,
                             layout=SimpleNamespace(abstract_canonical=lambda: here))
    meta = {"model": dataclasses.asdict(dataclasses.replace(model, attn_softcap=50.0,
                                                            rope_theta=500000.0)),
            "dtypes": {"params/embed/table": "float32"}}
    assert what_changed(meta, engine, TrainConfig()) == (
        " (model.rope_theta was 500000.0, now 10000.0; model.attn_softcap was 50.0, now "
        "None; parameters saved in float32, cast to bfloat16 (optim.param_dtype))")
    meta = {"model": dataclasses.asdict(model), "dtypes": {"params/embed/table": "bfloat16"}}
    assert what_changed(meta, engine, TrainConfig()) == ""


def test_a_resume_names_the_optimizer_moments_it_casts():
    """optim.mu_dtype changed between runs: the resume line says so (the restore casts)."""
    import dataclasses

    from framework.config import TrainConfig
    from framework.io.checkpoint.integrity import dtypes
    from framework.io.checkpoint.manager import to_nested
    from framework.run.start import what_changed
    from tests.helpers import OPTIM, engine

    saved = engine(optim=dataclasses.replace(OPTIM, mu_dtype="bfloat16"))
    meta = {"dtypes": dtypes(to_nested(saved.layout.abstract_canonical()))}
    now = engine(optim=dataclasses.replace(OPTIM, mu_dtype="float32", param_dtype="bfloat16"))
    assert what_changed(meta, now, TrainConfig()) == (
        " (parameters saved in float32, cast to bfloat16 (optim.param_dtype); optimizer "
        "moments saved in bfloat16, cast to float32 (optim.mu_dtype))")
    assert what_changed(meta, saved, TrainConfig()) == ""
