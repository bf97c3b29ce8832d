"""One training run from a `RunConfig`: devices, validation, engine, tracking, loop.

No Hydra here (`framework/run.py` turns the command line into a `RunConfig`); every
component gets only its slice of the configuration. User errors raise `ConfigError`
before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from functools import partial
from pathlib import Path

import jax

from framework import devices as devices_lib
from framework import flops
from framework.config import ConfigError, RunConfig, check, validate
from framework.data import make_dataset, sharded_batch
from framework.engine import build_engine
from framework.loop import LoopSettings, train_loop
from framework.mesh import describe, make_mesh
from framework.model import count_params, init_params
from framework.tracking import (JsonlSink, ProgressBar, Tracker, WandbSink, final_line)

WANDB_MODES = ("offline", "online", "disabled")


def check_run(cfg: RunConfig) -> None:
    """Everything that can be checked without devices (degrees against the device
    count come later, in `config.validate`)."""
    errs = check(cfg.model, cfg.parallel, cfg.train, None)
    if cfg.train.steps < 1:
        errs.append(f"train.steps={cfg.train.steps} must be >= 1")
    if cfg.logging.every < 1:
        errs.append(f"logging.every={cfg.logging.every} must be >= 1")
    if cfg.logging.wandb.mode not in WANDB_MODES:
        errs.append(f"logging.wandb.mode={cfg.logging.wandb.mode!r} is not one of "
                    f"{', '.join(WANDB_MODES)}")
    if cfg.devices.platform not in devices_lib.PLATFORMS:
        errs.append(f"devices.platform={cfg.devices.platform!r} is not one of "
                    f"{', '.join(devices_lib.PLATFORMS)}")
    if cfg.distributed.coordinator_address or (cfg.distributed.num_processes or 1) > 1:
        errs.append("distributed.*: multi-host runs are not wired into framework.run yet; "
                    "leave distributed.* unset")
    if errs:
        raise ConfigError("; ".join(errs))
    unwired = [name for name, value in (("eval.every", cfg.eval.every),
                                        ("checkpoint.every", cfg.checkpoint.every),
                                        ("train.resume_from", cfg.train.resume_from)) if value]
    if unwired:
        warnings.warn(f"{', '.join(unwired)} not wired into framework.run yet: ignored",
                      stacklevel=2)


def make_batches(dataset, engine):
    """step -> this process's rows of the step's batch, placed on the mesh as one
    global [global_batch, seq_len + 1] array (framework/data.py)."""
    sharding = engine.batch_sharding()
    return lambda step: sharded_batch(dataset.train_batch, step, sharding,
                                      dataset.global_shape)


def make_tracker(cfg: RunConfig, run_dir: Path, run_config: dict, base: dict) -> Tracker:
    sinks = [JsonlSink(run_dir)]
    if cfg.logging.progress:
        sinks.append(ProgressBar(cfg.train.steps))
    if cfg.logging.wandb.mode != "disabled":
        wandb_sink = WandbSink(cfg.logging.wandb, run_dir, base["run_name"], run_config)
        base = {**base, "wandb_dir": str(wandb_sink.dir)}
        sinks.append(wandb_sink)
    return Tracker(run_dir, sinks, base)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('h') else 's'}"


def start_line(mesh, simulated: bool, cfg: RunConfig, engine) -> str:
    sched = engine.schedule
    p = cfg.model
    return (f"{describe(mesh, simulated)} | {count_params(p) / 1e6:.2f}M params "
            f"(d_model {p.d_model}, {p.n_layers} layers, {p.dtype}) | schedule "
            f"{sched.name}: {_plural(sched.n_stages, 'stage')} x "
            f"{_plural(sched.n_microbatches, 'microbatch')}, "
            f"bubble {sched.formula_bubble:.1%} | batch {cfg.train.global_batch_size} x "
            f"{cfg.train.seq_len} tokens, {cfg.train.steps} steps")


def run(cfg: RunConfig, run_dir: Path, run_config: dict) -> dict:
    """Trains as configured, writing metrics.jsonl, summary.json (and W&B) in run_dir.
    run_config: the composed configuration as a plain dict (the W&B run config)."""
    started = time.perf_counter()
    check_run(cfg)
    dataset = make_dataset(cfg.data, cfg.train, cfg.model.vocab_size)
    devices_lib.enable_compile_cache()
    devset = devices_lib.start(cfg.devices, cfg.parallel)
    parallel = validate(cfg.model, cfg.parallel, cfg.train, len(devset))
    mesh = make_mesh(parallel, devset.devices)
    engine = build_engine(cfg.model, parallel, cfg.optim, cfg.train.steps, mesh)
    print(start_line(mesh, devset.simulated, cfg, engine), flush=True)

    run_config = {**run_config, "parallel": dataclasses.asdict(parallel)}
    base = {"mesh_name": parallel.mesh_name, "parallel": dataclasses.asdict(parallel),
            "run_name": cfg.logging.wandb.name or parallel.mesh_name,
            "n_devices": len(devset), "platform": devset.platform,
            "device_kind": devset.kind, "simulated_devices": devset.simulated,
            "n_params": count_params(cfg.model), "steps": cfg.train.steps}
    tracker = make_tracker(cfg, run_dir, run_config, base)
    try:
        summary = _train(cfg, engine, dataset, devset, tracker)
    except BaseException as err:  # record why, then let it propagate
        status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        tracker.finish(status, reason=f"{type(err).__name__}: {err}"[:500],
                       wall_time_s=time.perf_counter() - started)
        raise
    summary = tracker.finish("completed", wall_time_s=time.perf_counter() - started, **summary)
    print(final_line(summary), flush=True)
    return summary


def _train(cfg: RunConfig, engine, dataset, devset, tracker) -> dict:
    batches = make_batches(dataset, engine)
    # One jitted init (cacheable) instead of hundreds of small eager compilations.
    params = jax.jit(partial(init_params, cfg.model))(jax.random.key(cfg.train.seed))
    state = engine.init_state(params)
    stats = engine.compile(state, engine.shard_batch(batches(0)))
    peak = flops.peak_flops_per_device(devset.kind, cfg.model.dtype)
    per_token = flops.flops_per_token(cfg.model, cfg.train.seq_len)
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len

    def perf(step_time: float) -> dict:
        return flops.throughput(tokens_per_step / step_time, len(devset), per_token, peak)

    constants = {k: v for k, v in stats.items() if k.startswith("memory/peak")}
    if dataset.entropy_floor is not None:
        constants["data/entropy_floor"] = dataset.entropy_floor
    settings = LoopSettings(steps=cfg.train.steps, log_every=cfg.logging.every,
                            constants=constants,
                            once={"perf/compile_time_s": stats["perf/compile_time_s"]})
    tracker.summary.update(stats)
    tracker.summary["model/flops_per_token"] = per_token
    _, first_step_s = train_loop(engine, state, batches, settings, tracker, perf)
    return {"perf/first_step_time_s": first_step_s}
