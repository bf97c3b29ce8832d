"""One training run from a `RunConfig`: devices, validation, engine, checkpoints,
tracking, loop.

No Hydra here (`framework/run.py` turns the command line into a `RunConfig`); every
component gets only its slice of the configuration. User errors raise `ConfigError`
before anything is compiled.

A run continues where it left off: with `train.resume=auto` (default) it restores the
newest complete checkpoint of its own checkpoint folder (`checkpoint.dir`, default
`<run folder>/checkpoints`), else `train.resume_from`, and its metrics.jsonl and W&B
run carry on. How runs end early is in `framework/faults.py`.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np

from framework import checkpoint as ckpt_lib
from framework import devices as devices_lib
from framework import attention, distributed, flops, memory_check
from framework.checkpoint import Checkpointer, NonFiniteStateError
from framework.config import ConfigError, RunConfig, check, validate
from framework.data import make_dataset, sharded_batch
from framework.engine import build_engine
from framework.faults import Diverged, StopRequests
from framework.loop import Hook, LoopSettings, to_host, train_loop
from framework.mesh import describe, make_mesh
from framework.model import count_params, init_params
from framework.tracking import (JsonlSink, ProgressBar, Tracker, WandbSink, final_line,
                                read_metrics)

WANDB_MODES = ("offline", "online", "disabled")
CHECKPOINT_DIR = "checkpoints"  # inside the run folder, unless checkpoint.dir is set
# Model settings a checkpoint must share with the run restoring it (dtype is only the
# compute dtype: parameters are float32 whatever it is).
MODEL_SHAPE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                    "tie_embeddings")


def check_run(cfg: RunConfig) -> None:
    """Everything that can be checked without devices (degrees against the device
    count come later, in `config.validate`)."""
    errs = check(cfg.model, cfg.parallel, cfg.train, None)
    if cfg.train.steps < 1:
        errs.append(f"train.steps={cfg.train.steps} must be >= 1")
    if cfg.train.stop_at is not None and cfg.train.stop_at < 1:
        errs.append(f"train.stop_at={cfg.train.stop_at} must be >= 1 (or null)")
    if cfg.train.resume not in ckpt_lib.RESUME_MODES:
        errs.append(f"train.resume={cfg.train.resume!r} is not one of "
                    f"{', '.join(ckpt_lib.RESUME_MODES)}")
    for key, value, low in (("logging.every", cfg.logging.every, 1),
                            ("checkpoint.every", cfg.checkpoint.every, 0),
                            ("checkpoint.keep", cfg.checkpoint.keep, 1),
                            ("eval.every", cfg.eval.every, 0),
                            ("eval.batches", cfg.eval.batches, 1)):
        if value < low:
            errs.append(f"{key}={value} must be >= {low}")
    if cfg.logging.wandb.mode not in WANDB_MODES:
        errs.append(f"logging.wandb.mode={cfg.logging.wandb.mode!r} is not one of "
                    f"{', '.join(WANDB_MODES)}")
    if cfg.devices.platform not in devices_lib.PLATFORMS:
        errs.append(f"devices.platform={cfg.devices.platform!r} is not one of "
                    f"{', '.join(devices_lib.PLATFORMS)}")
    try:
        distributed.plan(cfg.distributed)
    except ConfigError as err:
        errs.append(str(err))
    if errs:
        raise ConfigError("; ".join(errs))


def make_batches(dataset, engine, fetch=None):
    """step -> this process's rows of the step's batch, placed on the mesh as one
    global [global_batch, seq_len + 1] array (framework/data.py)."""
    sharding = engine.batch_sharding()
    fetch = fetch or dataset.train_batch
    return lambda step: sharded_batch(fetch, step, sharding, dataset.global_shape)


def make_evaluator(engine, dataset, n_batches: int):
    """(step, state) -> {"eval/loss": mean forward-only loss over the first `n_batches`
    held-out batches} (the same batches at every evaluation)."""
    loss_fn = engine.eval_loss_fn()
    held_out = make_batches(dataset, engine, dataset.eval_batch)
    batches = [held_out(i) for i in range(n_batches)]

    def evaluate(step, state) -> dict:
        losses = [loss_fn(state["params"], tokens) for tokens in batches]
        return {"eval/loss": float(np.mean([to_host(x) for x in losses]))}

    return evaluate


def make_tracker(cfg: RunConfig, run_dir: Path, run_config: dict, base: dict,
                 primary: bool, resumed_at: int | None, start: int) -> Tracker:
    """Process 0: metrics.jsonl, progress bar, W&B, summary.json. Others: nothing."""
    if not primary:
        return Tracker(run_dir, [], base, write=False)
    sinks = [JsonlSink(run_dir, resumed_at)]
    if start >= cfg.train.steps:  # nothing to train: keep the last record's numbers
        records = read_metrics(run_dir) if resumed_at is not None else []
        return Tracker(run_dir, sinks, {**base, **(records[-1] if records else {})})
    if cfg.logging.progress:
        sinks.append(ProgressBar(cfg.train.steps, first=start))
    if cfg.logging.wandb.mode != "disabled":
        wandb_sink = WandbSink(cfg.logging.wandb, run_dir, base["run_name"], run_config,
                               resume=resumed_at is not None)
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


def resume_point(cfg: RunConfig, ckpt: Checkpointer) -> tuple[str, int] | None:
    """(checkpoint folder, step) this run starts from, or None; decided by process 0
    (framework/checkpoint.py's rules) and checked against this run's model."""
    try:
        point, err = ckpt_lib.resume_point(cfg.train, ckpt), None
    except ConfigError as error:
        point, err = None, str(error)
    point, err = distributed.agree([point, err])  # every process: process 0's answer
    if err:
        raise ConfigError(err)
    if point is None:
        return None
    folder, step = point
    reader = ckpt if folder == ckpt.directory else Checkpointer(folder, read_only=True)
    try:
        saved = reader.metadata(step).get("model", {})
    finally:
        if reader is not ckpt:
            reader.close()
    mine = dataclasses.asdict(cfg.model)
    differ = [f"model.{k}={saved[k]} there, {mine[k]} here" for k in MODEL_SHAPE_KEYS
              if k in saved and saved[k] != mine[k]]
    if differ:
        raise ConfigError(f"the checkpoint of step {step} in {folder} is of another model "
                          f"({'; '.join(differ)}): use its model settings, another "
                          f"output folder, or train.resume=never")
    return folder, step


def run(cfg: RunConfig, run_dir: Path, run_config: dict) -> dict:
    """Trains as configured, writing metrics.jsonl, summary.json (and W&B) in run_dir.
    run_config: the composed configuration as a plain dict (the W&B run config).
    Returns the summary; its status is completed, stopped (train.stop_at) or preempted
    (SIGTERM). Raises Diverged on a non-finite loss (summary status "diverged")."""
    started = time.perf_counter()
    check_run(cfg)
    dataset = make_dataset(cfg.data, cfg.train, cfg.model.vocab_size)
    if cfg.eval.every and not dataset.has_eval:
        raise ConfigError(f"eval.every={cfg.eval.every} needs held-out data but "
                          f"data.holdout_fraction={cfg.data.holdout_fraction}: set it > 0 "
                          f"or eval.every=0")
    devices_lib.enable_compile_cache()
    devset = devices_lib.start(cfg.devices, cfg.parallel, cfg.distributed)
    primary = devset.process_index == 0
    parallel = validate(cfg.model, cfg.parallel, cfg.train, len(devset))
    attention.check_platform(cfg.model, devset.platform)
    memory_check.check(cfg, parallel, devset)  # before anything is allocated or compiled
    mesh = make_mesh(parallel, devset.devices)
    engine = build_engine(cfg.model, parallel, cfg.optim, cfg.train.steps, mesh)

    # Every process saves into process 0's folder (the run folders of other processes
    # may differ, e.g. Hydra's default time-stamped ones).
    folder = str(cfg.checkpoint.dir or run_dir / CHECKPOINT_DIR)
    if "://" not in folder:  # local; remote (gs://...) paths are kept as given
        folder = str(Path(folder).expanduser().absolute())
    folder = distributed.agree(folder)
    ckpt = Checkpointer(folder, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    try:
        point = resume_point(cfg, ckpt)
        own = point is not None and point[0] == ckpt.directory
        if primary:
            print(start_line(mesh, devset.simulated, cfg, engine), flush=True)
            if point is not None:
                print(f"resuming from the checkpoint of step {point[1]} in {point[0]}",
                      flush=True)
        run_config = {**run_config, "parallel": dataclasses.asdict(parallel)}
        base = {"mesh_name": parallel.mesh_name, "parallel": dataclasses.asdict(parallel),
                "run_name": cfg.logging.wandb.name or parallel.mesh_name,
                "n_devices": len(devset), "n_processes": devset.process_count,
                "platform": devset.platform, "device_kind": devset.kind,
                "simulated_devices": devset.simulated, "n_params": count_params(cfg.model),
                "steps": cfg.train.steps, "checkpoint_dir": ckpt.directory,
                "resumed_from_step": None if point is None else point[1]}
        tracker = make_tracker(cfg, run_dir, run_config, base, primary,
                               resumed_at=point[1] if own else None,
                               start=0 if point is None else point[1])
        # From here on SIGTERM only sets a flag (also while restoring and compiling):
        # the run stops at the next step boundary, with a checkpoint.
        try:
            with StopRequests(multi_process=devset.process_count > 1,
                              stop_at=cfg.train.stop_at) as stop:
                status, summary = _train(cfg, engine, dataset, devset, tracker, ckpt, point,
                                         stop)
        except BaseException as err:  # record why, then let it propagate
            status = ("interrupted" if isinstance(err, KeyboardInterrupt) else
                      "diverged" if isinstance(err, Diverged) else "failed")
            if isinstance(err, Diverged):
                ckpt.wait()  # saves of earlier, good states finish
                latest = ckpt.latest_step()
                where = (f"the newest checkpoint is step {latest} in {ckpt.directory}"
                         if latest is not None else "no checkpoint was written")
                err.args = (f"training diverged: {err}; nothing saved after it, {where} "
                            f"(try a lower optim.lr or a longer optim.warmup_steps)",)
            reason = str(err) if isinstance(err, Diverged) else f"{type(err).__name__}: {err}"
            tracker.finish(status, reason=reason[:500],
                           wall_time_s=time.perf_counter() - started)
            raise
    finally:
        ckpt.close()
    summary = tracker.finish(status, wall_time_s=time.perf_counter() - started, **summary)
    if primary:
        print(final_line(summary), flush=True)
    return summary


def _train(cfg: RunConfig, engine, dataset, devset, tracker, ckpt: Checkpointer,
           point: tuple[str, int] | None, stop: StopRequests) -> tuple[str, dict]:
    """Restores or initializes the state, trains, saves the last checkpoint.
    Returns (status, numbers for the summary)."""
    batches = make_batches(dataset, engine)
    state = _initial_state(cfg, engine, ckpt, point, devset.process_count > 1)
    start = int(to_host(state["step"]))
    if start >= cfg.train.steps:
        if devset.process_index == 0:
            print(f"nothing to train: the checkpoint is at step {start} >= train.steps="
                  f"{cfg.train.steps}", flush=True)
        _save(ckpt, engine, state, start, cfg)  # into this run's folder (resume_from)
        ckpt.wait()
        return "completed", {"step": start}
    stats = engine.compile(state, engine.shard_batch(batches(start)))
    peak = flops.peak_flops_per_device(devset.kind, cfg.model.dtype)
    per_token = flops.flops_per_token(cfg.model, cfg.train.seq_len)
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len

    def perf(step_time: float) -> dict:
        return flops.throughput(tokens_per_step / step_time, len(devset), per_token, peak)

    # The compiled step's memory analysis and communication per mesh axis, in every record.
    constants = {k: v for k, v in stats.items()
                 if k.startswith(("memory/peak", "memory/temp", "comm/"))}
    if dataset.entropy_floor is not None:
        constants["data/entropy_floor"] = dataset.entropy_floor
    hooks = []
    if cfg.eval.every:
        hooks.append(Hook("eval", cfg.eval.every,
                          make_evaluator(engine, dataset, cfg.eval.batches), at_end=True))
    if cfg.checkpoint.every:
        hooks.append(Hook("checkpoint", cfg.checkpoint.every,
                          lambda step, state: _save(ckpt, engine, state, step, cfg),
                          after_log=True))
    settings = LoopSettings(steps=cfg.train.steps, log_every=cfg.logging.every, start=start,
                            constants=constants,
                            once={"perf/compile_time_s": stats["perf/compile_time_s"]})
    tracker.summary.update(stats)
    tracker.summary["model/flops_per_token"] = per_token
    result = train_loop(engine, state, batches, settings, tracker, perf, tuple(hooks), stop)
    # The last checkpoint: at the end, at train.stop_at, or on SIGTERM. A second SIGTERM
    # meanwhile only sets the flag again.
    _save(ckpt, engine, result.state, result.step, cfg)
    ckpt.wait()
    tracker.summary["step"] = result.step
    return result.stopped or "completed", {"perf/first_step_time_s": result.first_step_s,
                                           "last_checkpoint_step": ckpt.latest_step()}


def _initial_state(cfg: RunConfig, engine, ckpt: Checkpointer, point, multi: bool):
    if point is not None:
        folder, step = point
        if folder == ckpt.directory:
            return ckpt.restore(engine, step)
        other = Checkpointer(folder, read_only=True)
        try:
            return other.restore(engine, step)
        finally:
            other.close()
    # One jitted init (cacheable) instead of hundreds of small eager compilations.
    params = jax.jit(partial(init_params, cfg.model))(jax.random.key(cfg.train.seed))
    if multi:  # each process places its own shards from the (identical) host copy
        params = jax.device_get(params)
    return engine.init_state(params)


def _save(ckpt: Checkpointer, engine, state, step: int, cfg: RunConfig) -> None:
    """Starts an asynchronous save of `state` as step `step` (no-op if saved already)."""
    try:
        ckpt.save(step, engine, state, {"data": cfg.data.kind, "seed": cfg.train.seed,
                                        "train_steps": cfg.train.steps})
    except NonFiniteStateError as err:
        raise Diverged(step, str(err)) from None
