"""One training run from a `RunConfig`: devices, validation, engine, checkpoints,
tracking, loop.

No Hydra here (`framework/run.py` turns the command line into a `RunConfig`); every
component gets only its slice of the configuration. User errors raise `ConfigError`
before anything is compiled.

A run holds its folder (framework/runlock.py) from before JAX starts: one run per
folder. It continues where it left off: with `train.resume=auto` (default) it restores
the newest complete checkpoint of its own checkpoint folder (`checkpoint.dir`, default
`<run folder>/checkpoints`), unless `train.resume_from` names another starting point
(framework/checkpoint.py's rules), and its metrics.jsonl and W&B run carry on. A
checkpoint that is damaged is moved aside and the previous one used. How runs end
early is in `framework/faults.py`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from framework import checkpoint as ckpt_lib
from framework import devices as devices_lib
from framework import (attention, distributed, faults, flops, init_from, memory_check,
                       profiling, runlock)
from framework import resume as resume_lib
from framework import tokenizer as tokenizer_lib
from framework.checkpoint import Checkpointer, DamagedCheckpoint, NonFiniteStateError
from framework.config import ConfigError, RunConfig, check, check_ranges, validate
from framework.data import make_dataset, sharded_batch
from framework.engine import build_engine
from framework.faults import Diverged, StopRequests, StorageError
from framework.loop import Hook, LoopSettings, ProfileWindow, to_host, train_loop
from framework.mesh import describe, make_mesh
from framework.model import count_params, init_params
from framework.tracking import (JsonlSink, ProgressBar, Tracker, WandbSink, final_line,
                                read_metrics)

WANDB_MODES = ("offline", "online", "disabled")
CHECKPOINT_DIR = "checkpoints"  # inside the run folder, unless checkpoint.dir is set


def check_run(cfg: RunConfig) -> None:
    """Everything that can be checked without devices (degrees against the device
    count come later, in `config.validate`)."""
    errs = check_ranges(cfg)
    if errs:  # the checks below divide by some of these numbers
        raise ConfigError("; ".join(errs))
    errs = check(cfg.model, cfg.parallel, cfg.train, None)
    if cfg.train.resume not in ckpt_lib.RESUME_MODES:
        errs.append(f"train.resume={cfg.train.resume!r} is not one of "
                    f"{', '.join(ckpt_lib.RESUME_MODES)}")
    if cfg.logging.wandb.mode not in WANDB_MODES:
        errs.append(f"logging.wandb.mode={cfg.logging.wandb.mode!r} is not one of "
                    f"{', '.join(WANDB_MODES)}")
    if cfg.devices.platform not in devices_lib.PLATFORMS:
        errs.append(f"devices.platform={cfg.devices.platform!r} is not one of "
                    f"{', '.join(devices_lib.PLATFORMS)}")
    if cfg.eval.sample_prompt is not None and not cfg.eval.every:
        errs.append("eval.sample_prompt is written at each evaluation: set eval.every > 0")
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


def make_sampler(cfg: RunConfig, engine, codec, primary: bool):
    """(step, state) -> {"eval/sample": the greedy continuation of eval.sample_prompt}
    (framework/decode.py on the training mesh; the parameters are gathered over `pipe`
    for the sample, tensor-sharded as in training)."""
    from framework.decode import Decoder

    decoder = Decoder(cfg.model, engine.mesh)
    to_decoder = jax.jit(engine.canonical_params, out_shardings=decoder.param_shardings)
    prompt = codec.encode(cfg.eval.sample_prompt)
    if not prompt or max(prompt) >= cfg.model.vocab_size:
        raise ConfigError(f"eval.sample_prompt={cfg.eval.sample_prompt!r} encodes to "
                          f"{prompt[:8]}: need 1+ ids below model.vocab_size="
                          f"{cfg.model.vocab_size}")

    def sample(step, state) -> dict:
        ids = decoder.generate(to_decoder(state["params"]), [prompt], cfg.eval.sample_tokens)
        text = codec.decode(ids[0].tolist())
        if primary:
            print(f"sample at step {step}: {cfg.eval.sample_prompt!r} -> {text!r}", flush=True)
        return {"eval/sample": text}

    return sample


def make_tracker(cfg: RunConfig, run_dir: Path, run_config: dict, base: dict,
                 primary: bool, resumed_at: int | None, start: int) -> Tracker:
    """Process 0: metrics.jsonl, progress bar, W&B, summary.json. Others: nothing."""
    if not primary:
        return Tracker(run_dir, [], base, write=False)
    sinks = [JsonlSink(run_dir, resumed_at)]
    if sinks[0].kept_aside is not None:  # records that would otherwise be lost
        print(f"the earlier {sinks[0].path.name} is kept as {sinks[0].kept_aside}",
              flush=True)
    if start >= cfg.train.steps:  # nothing to train: keep the last record's numbers
        records = read_metrics(run_dir) if resumed_at is not None else []
        return Tracker(run_dir, sinks, {**base, **(records[-1] if records else {})})
    if cfg.logging.progress:
        sinks.append(ProgressBar(cfg.train.steps, first=start))
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


def held_folders(cfg: RunConfig, run_dir: Path) -> list[str]:
    """The folders this run must have to itself: the run folder, and the checkpoint
    folder when it is elsewhere (local paths only)."""
    folders = [str(Path(run_dir).absolute())]
    ckpt_dir = cfg.checkpoint.dir
    if ckpt_dir and "://" not in ckpt_dir:
        ckpt_dir = str(Path(ckpt_dir).expanduser().absolute())
        if not (ckpt_dir + "/").startswith(folders[0] + "/"):
            folders.append(ckpt_dir)
    return folders


def _process_index_before_start(launch: distributed.Plan | None) -> int | None:
    """This process's index when known before JAX starts (None: known only after)."""
    if launch is None:
        return 0
    if launch.process_id is not None:
        return launch.process_id
    rank = os.environ.get("SLURM_PROCID", "") if launch.source == "slurm" else ""
    return int(rank) if rank.isdigit() else None


def run(cfg: RunConfig, run_dir: Path, run_config: dict,
        on_start: Callable[[], None] | None = None, model_given=None) -> dict:
    """Trains as configured, writing metrics.jsonl, summary.json (and W&B) in run_dir.
    run_config: the composed configuration as a plain dict (the W&B run config).
    on_start: called once the run holds its folder (the command line writes .hydra/).
    model_given: names of the model.* settings the user or recipe set (checked against
    train.init_from's config.json; None: all of them).
    Returns the summary; its status is completed, stopped (train.stop_at) or preempted
    (SIGTERM). Raises ConfigError before anything is compiled for bad settings and
    runlock.FolderBusy when another run holds the folder; Diverged on a non-finite loss
    (summary status "diverged"); faults.StorageError when a save failed ("failed")."""
    cfg, hf_config = init_from.resolve(cfg, model_given)
    check_run(cfg)
    tokenizer = tokenizer_lib.for_run(cfg.data.kind, cfg.data.path, cfg.model.vocab_size,
                                      cfg.train.init_from)
    codec = None
    if cfg.eval.sample_prompt is not None:
        codec = tokenizer_lib.load(tokenizer, cfg.model.vocab_size)
        if codec is None:
            raise ConfigError("eval.sample_prompt needs to know the data's tokenizer: prepare "
                              "data.kind=tokens with tools/prepare_data.py --tokenizer, or "
                              "unset eval.sample_prompt")
    launch = distributed.plan(cfg.distributed)
    guard = runlock.Guard(held_folders(cfg, run_dir))
    if _process_index_before_start(launch) == 0:
        guard.take()  # before JAX starts: a second run on this folder stops at once
    if launch is None:
        guard.settle(0, 1)
    with guard:
        return _run(cfg, run_dir, run_config, guard, on_start,
                    {"hf_config": hf_config, "tokenizer": tokenizer, "codec": codec})


def _run(cfg: RunConfig, run_dir: Path, run_config: dict, guard: runlock.Guard,
         on_start: Callable[[], None] | None, model_io: dict) -> dict:
    started = time.perf_counter()
    dataset = make_dataset(cfg.data, cfg.train, cfg.model.vocab_size)
    if cfg.eval.every and not dataset.has_eval:
        raise ConfigError(f"eval.every={cfg.eval.every} needs held-out data but "
                          f"data.holdout_fraction={cfg.data.holdout_fraction}: set it > 0 "
                          f"or eval.every=0")
    devices_lib.enable_compile_cache()
    devset = devices_lib.start(cfg.devices, cfg.parallel, cfg.distributed)
    guard.settle(devset.process_index, devset.process_count)  # all follow process 0
    faults.run_started()  # a SIGTERM from now on asks the run to stop
    if on_start is not None:
        on_start()
    primary = devset.process_index == 0
    # What a checkpoint needs for generation and export besides the weights.
    save_meta = {"data": cfg.data.kind, "seed": cfg.train.seed, "train_steps": cfg.train.steps,
                 "seq_len": cfg.train.seq_len, "init_from": cfg.train.init_from,
                 "hf_config": model_io["hf_config"],
                 "tokenizer": tokenizer_lib.keep_in(model_io["tokenizer"], str(run_dir), primary)}
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
        if primary:
            print(start_line(mesh, devset.simulated, cfg, engine), flush=True)
        # From here on SIGTERM only sets a flag (also while restoring and compiling).
        with StopRequests(multi_process=devset.process_count > 1,
                          stop_at=cfg.train.stop_at) as stop:
            state, point = _start_state(cfg, engine, ckpt, devset)
            ckpt.lineage = resume_lib.lineage(cfg, ckpt, point)
            own = point is not None and point[0] == ckpt.directory
            run_config = {**run_config, "parallel": dataclasses.asdict(parallel)}
            base = {"mesh_name": parallel.mesh_name, "parallel": dataclasses.asdict(parallel),
                    "run_name": cfg.logging.wandb.name or parallel.mesh_name,
                    "n_devices": len(devset), "n_processes": devset.process_count,
                    "platform": devset.platform, "device_kind": devset.kind,
                    "simulated_devices": devset.simulated,
                    "n_params": count_params(cfg.model), "steps": cfg.train.steps,
                    "checkpoint_dir": ckpt.directory, "init_from": cfg.train.init_from,
                    "resumed_from_step": None if point is None else point[1]}
            tracker = make_tracker(cfg, run_dir, run_config, base, primary,
                                   resumed_at=point[1] if own else None,
                                   start=0 if point is None else point[1])
            try:
                status, summary = _train(cfg, engine, dataset, devset, tracker, ckpt, state,
                                         stop, save_meta, model_io["codec"])
            except BaseException as err:  # record why, then let it propagate
                _record_failure(tracker, ckpt, err, started)
                raise
    finally:
        ckpt.close()
    summary = tracker.finish(status, wall_time_s=time.perf_counter() - started, **summary)
    if primary:
        print(final_line(summary), flush=True)
    return summary


def _record_failure(tracker: Tracker, ckpt: Checkpointer, err: BaseException,
                    started: float) -> None:
    """summary.json for a run that ends with an exception (whose message is completed
    here for a divergence)."""
    status = ("interrupted" if isinstance(err, KeyboardInterrupt) else
              "diverged" if isinstance(err, Diverged) else "failed")
    if isinstance(err, Diverged):
        try:
            ckpt.wait()  # saves of earlier, good states finish
        except StorageError:
            pass  # reported as the newest good checkpoint below
        latest = ckpt.latest_step()
        where = (f"the newest checkpoint is step {latest} in {ckpt.directory}"
                 if latest is not None else "no checkpoint was written")
        err.args = (f"training diverged: {err}; nothing saved after it, {where} "
                    f"(try a lower optim.lr or a longer optim.warmup_steps)",)
    reason = (str(err) if isinstance(err, (Diverged, StorageError))
              else f"{type(err).__name__}: {err}")
    tracker.finish(status, reason=reason[:500], wall_time_s=time.perf_counter() - started)


def _start_state(cfg: RunConfig, engine, ckpt: Checkpointer, devset):
    """(the state this run starts from, the checkpoint it came from or None). A
    checkpoint that turns out damaged is reported in one line and the next one tried
    (framework/resume.py); the lines go to stderr, the choice to stdout."""
    primary = devset.process_index == 0
    multi = devset.process_count > 1

    def say(lines, stream=None):
        for line in lines if primary else ():
            print(line, file=stream or sys.stdout, flush=True)

    point, notes = resume_lib.start_point(cfg, ckpt, primary)
    say([n for n in notes if n.startswith("warning:")], sys.stderr)
    say([n for n in notes if not n.startswith("warning:")])
    while point is not None:
        try:
            resume_lib.check_model(cfg, ckpt, point)
            state = _initial_state(cfg, engine, ckpt, point, multi)
            say([f"resuming from the checkpoint of step {point[1]} in {point[0]}"])
            return state, point
        except DamagedCheckpoint as err:
            point, notes = resume_lib.fall_back(cfg, ckpt, err, primary)
            say(notes, sys.stderr)
    return _initial_state(cfg, engine, ckpt, None, multi), None


def _nothing_new(ckpt: Checkpointer, start: int, primary: bool) -> tuple[str, dict]:
    """A SIGTERM came before the first step (while restoring or compiling)."""
    latest = ckpt.latest_step()
    if primary:
        where = (f"the newest checkpoint is step {latest} in {ckpt.directory}"
                 if latest is not None else "no checkpoint yet")
        print(f"SIGTERM before the first step: nothing new to save ({where})", flush=True)
    return "preempted", {"step": start, "last_checkpoint_step": latest}


def _train(cfg: RunConfig, engine, dataset, devset, tracker, ckpt: Checkpointer, state,
           stop: StopRequests, save_meta: dict, codec=None) -> tuple[str, dict]:
    """Trains from `state`, saves the last checkpoint. Returns (status, numbers for
    the summary)."""
    batches = make_batches(dataset, engine)
    primary = devset.process_index == 0
    start = int(to_host(state["step"]))
    tracker.summary["step"] = start
    if start >= cfg.train.steps:
        if primary:
            print(f"nothing to train: the checkpoint is at step {start} >= train.steps="
                  f"{cfg.train.steps}", flush=True)
        _save(ckpt, engine, state, start, save_meta, tracker)  # into this run's folder
        ckpt.wait()
        return "completed", {"step": start}
    if stop.before_first_step():
        return _nothing_new(ckpt, start, primary)
    stats = engine.compile(state, engine.shard_batch(batches(start)))
    if stop.before_first_step():  # came while compiling (the cache keeps the program)
        return _nothing_new(ckpt, start, primary)
    peak = flops.peak_flops_per_device(devset.kind, cfg.model.dtype)
    per_token = flops.flops_per_token(cfg.model, cfg.train.seq_len)
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len

    def perf(step_time: float) -> dict:
        return flops.throughput(tokens_per_step / step_time, len(devset), per_token, peak)

    def boundary(step: int) -> str | None:
        """Every step: a failed background save stops the run here (one process; with
        several, at the next checkpoint, where all of them check together)."""
        if devset.process_count == 1:
            ckpt.raise_if_save_failed()
        return stop(step)

    # The compiled step's memory analysis and communication per mesh axis, in every record.
    constants = {k: v for k, v in stats.items()
                 if k.startswith(("memory/peak", "memory/temp", "comm/"))}
    if dataset.entropy_floor is not None:
        constants["data/entropy_floor"] = dataset.entropy_floor
    hooks = []
    if cfg.eval.every:
        hooks.append(Hook("eval", cfg.eval.every,
                          make_evaluator(engine, dataset, cfg.eval.batches), at_end=True))
    if cfg.eval.sample_prompt is not None:
        hooks.append(Hook("sample", cfg.eval.every,
                          make_sampler(cfg, engine, codec, devset.process_index == 0),
                          at_end=True))
    if cfg.checkpoint.every:
        hooks.append(Hook("checkpoint", cfg.checkpoint.every,
                          lambda step, state: _save(ckpt, engine, state, step, save_meta,
                                                    tracker),
                          after_log=True))
    settings = LoopSettings(steps=cfg.train.steps, log_every=cfg.logging.every, start=start,
                            constants=constants,
                            once={"perf/compile_time_s": stats["perf/compile_time_s"]})
    tracker.summary.update(stats)
    tracker.summary["model/flops_per_token"] = per_token
    profile = _profile_window(cfg, engine, start, tracker) if devset.process_index == 0 else None
    result = train_loop(engine, state, batches, settings, tracker, perf, tuple(hooks),
                        boundary, profile)
    # The last checkpoint: at the end, at train.stop_at, or on SIGTERM; the run exits
    # only once it (and any save still in flight) is on disk. A second SIGTERM
    # meanwhile only sets the flag again.
    _save(ckpt, engine, result.state, result.step, save_meta, tracker)
    ckpt.wait()
    tracker.summary["step"] = result.step
    return result.stopped or "completed", {"perf/first_step_time_s": result.first_step_s,
                                           "last_checkpoint_step": ckpt.latest_step(),
                                           **{f"checkpoint/{k}": v
                                              for k, v in ckpt.stats.items()}}


def _profile_window(cfg: RunConfig, engine, start: int, tracker) -> ProfileWindow | None:
    """The steps traced to time the pipeline bubble (framework/profiling.py); their
    per-rank bubble goes to summary.json."""
    last = min(cfg.train.steps, cfg.train.stop_at or cfg.train.steps)
    window = profiling.profile_steps(cfg.profile.steps, cfg.profile.start_step, start, last)
    if window is None:
        return None
    profiler = profiling.Profiler(engine, tracker.run_dir, cfg.profile.keep_trace_mb)

    def stop() -> dict:
        found = profiler.stop()
        tracker.summary.update(found)
        return found

    return ProfileWindow(window[0], window[1], profiler.start, stop)


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
    if cfg.train.init_from:
        return init_from.initial_state(engine, cfg.train.init_from)
    # One jitted init (cacheable) instead of hundreds of small eager compilations.
    params = jax.jit(partial(init_params, cfg.model))(jax.random.key(cfg.train.seed))
    if multi:  # each process places its own shards from the (identical) host copy
        params = jax.device_get(params)
    return engine.init_state(params)


def _save(ckpt: Checkpointer, engine, state, step: int, meta: dict,
          tracker: Tracker | None = None) -> None:
    """Starts an asynchronous save of `state` as step `step` (no-op if saved already),
    once the records of its steps are durable. Raises StorageError if a save failed
    (checked on every process together), Diverged for a non-finite state."""
    failure = distributed.first_error(ckpt.failed_save())
    if failure:
        raise StorageError(failure)
    if tracker is not None:
        tracker.sync()
    warning = ckpt.low_space_warning()
    if warning and not ckpt.warned and distributed.is_primary():
        print(warning, flush=True)
        ckpt.warned = True
    try:
        ckpt.save(step, engine, state, meta)
    except NonFiniteStateError as err:
        raise Diverged(step, str(err)) from None
