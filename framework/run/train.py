"""One training run from a `RunConfig`, in the order it happens:

    settings checked            (framework/run/checks.py; the model read from
                                 train.init_from: framework/run/start.py)
    the run folder held         (framework/runtime/runlock.py), before JAX starts
    devices started             (framework/runtime/devices.py; other processes joined)
    layout validated, memory    (framework/engine/validate.py,
    checked, engine built        framework/analysis/memory_check.py, framework/engine/)
    the start state             (framework/run/start.py: a checkpoint, or fresh weights)
    compiled, then the loop     (framework/run/loop.py, with framework/run/hooks.py)
    the last checkpoint saved, summary.json written

No Hydra here (`framework/run/cli.py` turns the command line into a `RunConfig`); each
step gets only its slice of the configuration. User errors raise `ConfigError` before
anything is compiled. How runs end early is in `framework/runtime/faults.py`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from framework.analysis import audit, flops, memory_check
from framework.model.flops import model_flops_per_token
from framework.config import RunConfig
from framework.engine.build import Engine, build_engine
from framework.engine.validate import check_platform, validate
from framework.errors import ConfigError, Diverged, StorageError
from framework.io import tokenizer as tokenizer_lib
from framework.io.checkpoint.manager import Checkpointer
from framework.io.checkpoint.paths import COMPLETE_MARKERS
from framework.io.corpus_dataset import eval_sets
from framework.io.data import Dataset, document_mask, make_dataset
from framework.model.registry import spec_of
from framework.parallel.mesh import describe, make_mesh, mesh_name
from framework.run import start
from framework.run.checks import check_no_decay, check_run, clamp_warmup, sample_codec
from framework.run.hooks import (make_batches, make_evaluator, make_sampler, profile_window,
                                 save_checkpoint)
from framework.run.loop import Hook, LoopSettings, to_host, train_loop
from framework.run.sinks import make_tracker
from framework.run.tracking import Tracker, final_line
from framework.runtime import devices as devices_lib
from framework.runtime import distributed, faults, peers, runlock
from framework.runtime.faults import StopRequests

CHECKPOINT_DIR = "checkpoints"  # inside the run folder, unless checkpoint.dir is set


def run(cfg: RunConfig, run_dir: Path, run_config: dict,
        on_start: Callable[[], None] | None = None, model_given=None) -> dict:
    """Trains as configured, writing metrics.jsonl, summary.json (and W&B) in run_dir.
    run_config: the composed configuration as a plain dict (the W&B run config).
    on_start: called once the run holds its folder (the command line writes .hydra/).
    model_given: names of the model.* settings the user or recipe set (checked against
    train.init_from's config.json; None: all of them).
    Returns the summary; its status is completed, stopped (train.stop_at) or preempted
    (SIGTERM). Raises ConfigError before anything is compiled for bad settings and
    FolderBusy when another run holds the folder; Diverged on a non-finite loss
    (summary status "diverged"); StorageError when a save failed ("failed")."""
    model, train, hf_config = start.resolve_init_from(cfg.model, cfg.train, model_given)
    cfg = dataclasses.replace(cfg, model=model, train=train)
    check_run(cfg)
    cfg, warning = clamp_warmup(cfg)
    if warning and _process_index_before_start(distributed.plan(cfg.distributed)) in (0, None):
        print(warning, file=sys.stderr, flush=True)
    tokenizer = tokenizer_lib.for_run(cfg.data.kind, cfg.data.path, cfg.model.vocab_size,
                                      cfg.train.init_from, cfg.data.mixture)
    codec = sample_codec(cfg, tokenizer, hf_config)
    launch = distributed.plan(cfg.distributed)
    guard = runlock.Guard(held_folders(cfg, run_dir))
    if _process_index_before_start(launch) == 0:
        guard.take()  # before JAX starts: a second run on this folder stops at once
    if launch is None:
        guard.settle(0, 1)
    with guard:
        return _run(cfg, run_dir, run_config, guard, on_start,
                    {"hf_config": hf_config, "tokenizer": tokenizer, "codec": codec})


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


def _run(cfg: RunConfig, run_dir: Path, run_config: dict, guard: runlock.Guard,
         on_start: Callable[[], None] | None, model_io: dict) -> dict:
    started = time.perf_counter()
    dataset = make_dataset(cfg.data, cfg.train, cfg.model.vocab_size)
    sets = eval_sets(cfg.eval, cfg.data, cfg.train, cfg.model.vocab_size,
                     model_io["tokenizer"])
    documents = document_mask(cfg.data, dataset, sets)
    if cfg.eval.every and not dataset.has_eval:
        raise ConfigError(f"eval.every={cfg.eval.every} needs held-out data but "
                          f"data.holdout_fraction={cfg.data.holdout_fraction}: set it > 0 "
                          f"or eval.every=0")
    devset = devices_lib.start(cfg.devices, cfg.parallel, cfg.distributed)
    devices_lib.enable_compile_cache(devset)
    guard.settle(devset.process_index, devset.process_count)  # all follow process 0
    peers.tell(process=devset.process_index, processes=devset.process_count)
    faults.run_started()  # a SIGTERM from now on asks the run to stop
    if on_start is not None:
        on_start()
    primary = devset.process_index == 0
    # What a checkpoint needs for generation and export besides the weights.
    meta = {"data": cfg.data.kind, "seed": cfg.train.seed, "train_steps": cfg.train.steps,
            "optim": cfg.optim.name, "seq_len": cfg.train.seq_len,
            "init_from": cfg.train.init_from, "hf_config": model_io["hf_config"],
            "tokenizer": tokenizer_lib.keep_in(model_io["tokenizer"], str(run_dir), primary),
            "tokenizer_sha256": tokenizer_lib.fingerprint(model_io["tokenizer"])}
    engine = _build(cfg, devset, documents)
    meta["layout"] = mesh_name(engine.parallel)  # said when a resume reshards
    ckpt = Checkpointer(_checkpoint_folder(cfg, run_dir), keep=cfg.checkpoint.keep,
                        async_save=cfg.checkpoint.async_save)
    try:
        if primary:
            print(start_line(devset.simulated, cfg, engine), flush=True)
        # From here on SIGTERM only sets a flag (also while restoring and compiling).
        with StopRequests(multi_process=devset.process_count > 1,
                          stop_at=cfg.train.stop_at) as stop:
            state, point = start.start_state(cfg.model, cfg.train, engine, ckpt, devset, meta)
            ckpt.lineage = start.lineage_of(cfg.train, ckpt, point)
            tracker = _tracker(cfg, run_dir, run_config, engine, devset, ckpt, point)
            parts = _Parts(cfg, engine, dataset, devset, tracker, ckpt, stop, sets)
            try:
                status, summary = _train(parts, state, meta, model_io["codec"])
            except BaseException as err:  # record why, then let it propagate
                _record_failure(tracker, ckpt, err, started)
                if devset.process_count > 1:  # a vanished peer: JAX's verdict is coming
                    peers.await_verdict(err, cfg.distributed.heartbeat_timeout_s + 15)
                raise
    finally:
        ckpt.close()
    summary = tracker.finish(status, wall_time_s=time.perf_counter() - started, **summary)
    if primary:
        print(final_line(summary), flush=True)
        print(f"run folder: {run_dir}", flush=True)
    return summary


def _build(cfg: RunConfig, devset, documents=None):
    """The engine for these devices, once the layout is valid for them, the attention
    kernel runs on their platform and the run is predicted to fit their memory."""
    parallel = validate(cfg.model, cfg.parallel, cfg.train, len(devset))
    check_platform(cfg.model, devset.platform)
    memory_check.check(cfg, parallel, devset)  # CPU: predicted, before anything is compiled
    mesh = make_mesh(parallel, devset.devices)
    engine = build_engine(cfg.model, parallel, cfg.optim, cfg.train.steps, mesh, documents)
    check_no_decay(cfg.optim.no_decay, engine.abstract_params())  # names the unmatched
    memory_check.check_compiled(cfg, engine, devset)  # GPU/TPU: compiled, nothing allocated
    return engine


def watch_peers(cfg: RunConfig, run_dir: Path, log_path: Path) -> None:
    """A multi-process run says in one line when a peer vanishes (framework/runtime/peers.py).
    Called by the command line before the run starts JAX."""
    try:
        launch = distributed.plan(cfg.distributed)
    except ConfigError:
        return  # run() says so
    if launch is None:
        return
    folder = str(cfg.checkpoint.dir or run_dir / CHECKPOINT_DIR)
    peers.watch({"run_dir": str(Path(run_dir).absolute()), "log": str(log_path),
                 "checkpoints": str(Path(folder).expanduser().absolute()),
                 "markers": list(COMPLETE_MARKERS),
                 "process": _process_index_before_start(launch),
                 "processes": distributed.expected_processes(launch),
                 "heartbeat_timeout_s": cfg.distributed.heartbeat_timeout_s})


def _checkpoint_folder(cfg: RunConfig, run_dir: Path) -> str:
    """checkpoint.dir, or <run folder>/checkpoints: process 0's (the run folders of other
    processes may differ, e.g. Hydra's default time-stamped ones)."""
    folder = str(cfg.checkpoint.dir or run_dir / CHECKPOINT_DIR)
    if "://" not in folder:  # local; remote (gs://...) paths are kept as given
        folder = str(Path(folder).expanduser().absolute())
    return distributed.agree(folder)


def _tracker(cfg: RunConfig, run_dir: Path, run_config: dict, engine, devset,
             ckpt: Checkpointer, point) -> Tracker:
    """The run's tracker, with what summary.json records from the start."""
    parallel = engine.parallel
    own = point is not None and point[0] == ckpt.directory
    base = {"mesh_name": mesh_name(parallel), "parallel": dataclasses.asdict(parallel),
            "run_name": cfg.logging.wandb.name or mesh_name(parallel),
            "n_devices": len(devset), "n_processes": devset.process_count,
            "platform": devset.platform, "device_kind": devset.kind,
            "simulated_devices": devset.simulated,
            "n_params": spec_of(cfg.model).count_params(cfg.model), "steps": cfg.train.steps,
            "checkpoint_dir": ckpt.directory, "init_from": cfg.train.init_from,
            "resumed_from_step": None if point is None else point[1]}
    return make_tracker(cfg, run_dir, {**run_config, "parallel": base["parallel"]}, base,
                        devset.process_index == 0, resumed_at=point[1] if own else None,
                        start=0 if point is None else point[1])


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('h') else 's'}"


def _layers_per_stage(counts) -> str:
    return "" if counts is None else f" (layers {'/'.join(map(str, counts))})"


def start_line(simulated: bool, cfg: RunConfig, engine) -> str:
    sched, p, kept = engine.schedule, cfg.model, cfg.optim.param_dtype
    stored = "" if kept == "float32" else f", stored in {kept}"
    return (f"{describe(engine.mesh, simulated)} | {spec_of(p).count_params(p) / 1e6:.2f}M params "
            f"(d_model {p.d_model}, {p.n_layers} layers, {p.dtype}{stored}) | schedule "
            f"{sched.name}: {_plural(sched.n_stages, 'stage')}"
            f"{_layers_per_stage(engine.layout.stage_layers)} x "
            f"{_plural(sched.n_microbatches, 'microbatch')}, "
            f"bubble {sched.formula_bubble:.1%} | batch {cfg.train.global_batch_size} x "
            f"{cfg.train.seq_len} tokens, {cfg.train.steps} steps")


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


def _nothing_new(ckpt: Checkpointer, start_step: int, primary: bool) -> tuple[str, dict]:
    """A SIGTERM came before the first step (while restoring or compiling)."""
    latest = ckpt.latest_step()
    if primary:
        where = (f"the newest checkpoint is step {latest} in {ckpt.directory}"
                 if latest is not None else "no checkpoint yet")
        print(f"SIGTERM before the first step: nothing new to save ({where})", flush=True)
    return "preempted", {"step": start_step, "last_checkpoint_step": latest}


@dataclass(frozen=True)
class _Parts:
    """What the training of a started run works with: its settings, the engine, the
    data, the devices, where records and checkpoints go, and the stop requests."""

    cfg: RunConfig
    engine: Engine
    dataset: Dataset
    devset: devices_lib.DeviceSet
    tracker: Tracker
    ckpt: Checkpointer
    stop: StopRequests
    eval_sets: dict  # name -> Dataset (eval.sets)


def _train(parts: _Parts, state, meta: dict, codec=None) -> tuple[str, dict]:
    """Trains from `state`, saves the last checkpoint. `meta`: what every checkpoint
    records besides the weights; `codec`: the tokenizer of eval.sample_prompt. Returns
    (status, numbers for the summary)."""
    cfg, engine, devset, tracker, ckpt = (parts.cfg, parts.engine, parts.devset,
                                          parts.tracker, parts.ckpt)
    batches = make_batches(parts.dataset, engine)
    primary = devset.process_index == 0
    first = int(to_host(state["step"]))
    tracker.summary["step"] = first
    save = lambda step, state: save_checkpoint(ckpt, engine, state, step, meta, tracker)
    if first >= cfg.train.steps:
        if primary:
            print(f"nothing to train: the checkpoint is at step {first} >= train.steps="
                  f"{cfg.train.steps}", flush=True)
        save(first, state)  # into this run's folder
        ckpt.wait()
        return "completed", {"step": first}
    if parts.stop.before_first_step():
        return _nothing_new(ckpt, first, primary)
    stats = audit.step_stats(engine, state, engine.shard_batch(batches(first)))
    if parts.stop.before_first_step():  # came while compiling (the cache keeps the program)
        return _nothing_new(ckpt, first, primary)
    tracker.summary.update(stats)
    per_token = model_flops_per_token(cfg.model, cfg.train.seq_len)
    tracker.summary["model/flops_per_token"] = per_token
    perf = flops.per_step_time(devset.kind, cfg.model.dtype, len(devset),
                               cfg.train.global_batch_size * cfg.train.seq_len, per_token,
                               cfg.model.fp8)
    tracker.summary["perf/mfu_format"] = flops.matmul_format(cfg.model.fp8, cfg.model.dtype)
    settings = _loop_settings(cfg, first, stats, parts.dataset, perf)
    result = train_loop(engine, state, batches, settings, tracker,
                        _hooks(cfg, engine, parts, codec, save),
                        _boundary(ckpt, devset, parts.stop),
                        profile_window(cfg.profile, min(cfg.train.steps, cfg.train.stop_at
                                                        or cfg.train.steps), engine, first,
                                       tracker) if primary else None)
    # The last checkpoint: at the end, at train.stop_at, or on SIGTERM; the run exits
    # only once it (and any save still in flight) is on disk. A second SIGTERM
    # meanwhile only sets the flag again.
    save(result.step, result.state)
    ckpt.wait()
    tracker.summary["step"] = result.step
    return result.stopped or "completed", {"perf/first_step_time_s": result.first_step_s,
                                           "last_checkpoint_step": ckpt.latest_step(),
                                           **{f"checkpoint/{k}": v
                                              for k, v in ckpt.stats.items()}}


def _loop_settings(cfg: RunConfig, first: int, stats: dict, dataset,
                   perf: Callable[[float], dict]) -> LoopSettings:
    """The compiled step's memory analysis and communication per mesh axis (and the
    data's entropy floor) go into every record, the compile time into the first; `perf`
    turns a step time into the perf/* metrics."""
    constants = {k: v for k, v in stats.items()
                 if k.startswith(("memory/peak", "memory/temp", "comm/"))}
    if dataset.entropy_floor is not None:
        constants["data/entropy_floor"] = dataset.entropy_floor
    return LoopSettings(steps=cfg.train.steps, log_every=cfg.logging.every, start=first,
                        constants=constants,
                        once={"perf/compile_time_s": stats["perf/compile_time_s"]}, perf=perf,
                        prefetch=cfg.data.prefetch)


def _boundary(ckpt: Checkpointer, devset, stop: StopRequests):
    """Every step: a failed background save stops the run here (one process; with
    several, at the next checkpoint, where all of them check together)."""
    def boundary(step: int) -> str | None:
        if devset.process_count == 1:
            ckpt.raise_if_save_failed()
        return stop(step)

    return boundary


def _hooks(cfg: RunConfig, engine, parts: _Parts, codec, save) -> tuple[Hook, ...]:
    hooks, devset = [], parts.devset
    if cfg.eval.every:
        hooks.append(Hook("eval", cfg.eval.every,
                          make_evaluator(engine, parts.dataset, cfg.eval.batches), at_end=True))
    for name, held_out in parts.eval_sets.items():  # eval.sets: eval/<name>/loss
        hooks.append(Hook(f"eval {name}", cfg.eval.every,
                          make_evaluator(engine, held_out, cfg.eval.batches, name),
                          at_end=True))
    if cfg.eval.sample_prompt is not None:
        hooks.append(Hook("sample", cfg.eval.every,
                          make_sampler(cfg.model, cfg.eval, engine, codec,
                                       devset.process_index == 0), at_end=True))
    if cfg.checkpoint.every:
        hooks.append(Hook("checkpoint", cfg.checkpoint.every, save, after_log=True))
    return tuple(hooks)
