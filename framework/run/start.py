"""Where a run starts: from its own newest checkpoint, from another run's
(`train.resume_from`), from a Hugging Face folder (`train.init_from`) or from fresh
weights; what is moved aside on the way; what happens when the chosen checkpoint turns
out damaged. Every rule of it is in this module, but for what a resume may find changed
besides the model (another optimizer, another tokenizer: framework/run/resume.py).

    train.init_from=<HF folder>                the model settings come from its
                                               config.json (`resolve_init_from`); the run
                                               starts at step 0 from its weights, unless
                                               it has checkpoints of its own
    train.resume_from wins over the run's own  except over checkpoints this same command
    checkpoints                                made: each checkpoint records the
                                               resume_from its chain of runs started from
                                               (`lineage`), so the command, run again after
                                               a preemption, continues its own progress;
                                               own checkpoints newer than the start step
                                               are moved aside as <step>.superseded
    train.resume=auto                          the newest complete own checkpoint, else a
                                               fresh start; `never`: the own folder must
                                               hold no checkpoint
    step folders missing a completion marker   moved aside as <step>.damaged at the start
                                               (so that step can be saved again)
    the checkpoint to restore is damaged       own folder: moved aside as <step>.damaged,
    (DamagedCheckpoint)                        the rules applied again (the previous
                                               checkpoint, else resume_from, else step 0);
                                               another run's folder (resume_from): left in
                                               place, the previous step there is used;
                                               a step named explicitly: a one-line error

Process 0 decides and alone moves step folders (nothing is ever deleted); the other
processes follow its answer (`distributed.agree`) and re-read the folder.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from functools import partial

import jax

from framework.config import ModelConfig, TrainConfig, not_one_of
from framework.engine.build import Engine
from framework.errors import ConfigError, DamagedCheckpoint
from framework.io.checkpoint import integrity
from framework.io.checkpoint.integrity import short_reason
from framework.io.checkpoint.manager import Checkpointer, to_nested
from framework.io.checkpoint.paths import absolute, locate
from framework.io.hf import llama as hf
from framework.io.hf.safetensors import Tensors
from framework.io.weights import model_config_from_dict
from framework.model.registry import spec_of
from framework.parallel.mesh import mesh_name
from framework.run.resume import check_same_tokenizer, other_optimizer, restore_weights
from framework.runtime import distributed

Point = tuple[str, int]  # (checkpoint folder, step)
# Model settings a checkpoint must share with the run restoring it (dtype is only the
# compute dtype; the stored one, optim.param_dtype, may change: the state is cast).
MODEL_SHAPE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                    "tie_embeddings")
# ... and what the family settings make of them (read from a ModelConfig: a checkpoint
# from before the families holds none of the settings, and was a Llama)
FAMILY_SHAPE_KEYS = {"has_qkv_bias": "model.qkv_bias", "has_qk_norm": "model.qk_norm",
                     "head_dim": "the head width (model.explicit_head_dim)",
                     "has_post_norms": "model.post_norms",
                     "has_norm_plus_one": "model.norm_plus_one",
                     "moe_shape": "model.moe's (experts, expert_hidden, shared_experts, "
                                  "shared_hidden, shared_gate, first_dense, every, a balancing "
                                  "bias)"}
# Settings that change what the same parameters compute: a resume may change them
# (e.g. RoPE for a longer context), and its line says so.
MATHS_KEYS = {"dtype": "model.dtype", "mlp_activation": "model.activation", "has_embed_scale": "model.embed_scale",
              "rope_theta": "model.rope_theta", "rope_scaling": "model.rope_scaling",
              "norm_eps": "model.norm_eps", "sliding_window": "model.sliding_window",
              "sliding_window_pattern": "model.sliding_window_pattern",
              "query_pre_attn_scalar": "model.query_pre_attn_scalar",
              "attn_softcap": "model.attn_softcap", "final_softcap": "model.final_softcap",
              "fp8": "model.fp8"}  # FP8 holds no state: a run resumes with or without it


# --- train.init_from: the model settings --------------------------------------------

def resolve_init_from(model: ModelConfig, train: TrainConfig, model_given=None):
    """(model, train, the folder's config.json): with train.init_from, the model settings
    of its config.json and the folder as an absolute path; else the settings unchanged
    and None. model_given: names of the model.* settings set explicitly (on the command
    line or by the recipe); None: every one counts as set."""
    folder = train.init_from
    if not folder:
        return model, train, None
    if train.resume_from:
        raise ConfigError(f"train.init_from={folder} and train.resume_from="
                          f"{train.resume_from} both say where to start: set one")
    folder = os.path.abspath(os.path.expanduser(folder))
    if not os.path.isdir(folder):
        raise ConfigError(f"train.init_from={train.init_from} is not a folder")
    where = os.path.join(folder, hf.CONFIG_FILE)
    config = hf.read_config(folder)
    names = [f.name for f in dataclasses.fields(model)] if model_given is None else model_given
    given = {k: getattr(model, k) for k in names}
    model = hf.merge_model(given, hf.model_config(config, where, model.dtype), where)
    hf.check_tensors(Tensors(folder), model, folder)  # before anything compiles
    return model, dataclasses.replace(train, init_from=folder), config


# --- Which checkpoint ------------------------------------------------------------------

def lineage_of(train: TrainConfig, ckpt: Checkpointer, point: Point | None) -> str | None:
    """What this run's checkpoints record as the train.resume_from their chain started
    from: the setting if given (absolute); else that of the own checkpoint it continues."""
    if train.resume_from:
        return absolute(train.resume_from)
    if point is not None and point[0] == ckpt.directory:
        return _recorded_lineage(ckpt, point[1])
    return None


def _recorded_lineage(ckpt: Checkpointer, step: int) -> str | None:
    try:
        return ckpt.metadata(step).get("resume_from")
    except Exception:  # unreadable: the restore will find it damaged
        return None


def resume_point(train: TrainConfig, own: Checkpointer) -> Point | None:
    """Where a run starts from (the rules of the module docstring): (checkpoint folder,
    step), or None for a fresh start."""
    problem = not_one_of("train.resume", train.resume)
    if problem:
        raise ConfigError(problem)
    latest = own.latest_step()
    if latest is not None and train.resume == "never":
        raise ConfigError(f"train.resume=never but {own.directory} already holds a "
                          f"checkpoint (step {latest}): use another output folder or "
                          f"train.resume=auto")
    if train.resume_from:
        if latest is not None and _recorded_lineage(own, latest) == absolute(train.resume_from):
            return own.directory, latest  # this command ran here before: continue it
        return _named_point(train.resume_from)
    return (own.directory, latest) if latest is not None else None


def _named_point(resume_from: str) -> Point:
    found = locate(resume_from)
    if found is None:
        raise ConfigError(f"train.resume_from={resume_from} is not a checkpoint "
                          f"folder, a run folder with checkpoints/, or a step folder")
    other = Checkpointer(found.folder, async_save=False, read_only=True)
    try:
        step = other.pick(found.step)
    except FileNotFoundError as err:
        raise ConfigError(f"train.resume_from={resume_from}: {err}") from None
    finally:
        other.close()
    return found.folder, step


def _decided_by_process_0(primary: bool, decide) -> tuple[Point | None, list[str]]:
    """Runs `decide() -> (point, notes)` on process 0 (ConfigError included) and gives
    every process its answer."""
    point, notes, err = None, [], None
    if primary:
        try:
            point, notes = decide()
        except ConfigError as error:
            err = str(error)
    point, notes, err = distributed.agree([point, notes, err])
    if err:
        raise ConfigError(err)
    return (None if point is None else (str(point[0]), int(point[1]))), notes


def start_point(train: TrainConfig, ckpt: Checkpointer, primary: bool):
    """(the checkpoint to start from or None, lines to print). Incomplete step folders
    and, when train.resume_from wins, newer own checkpoints are moved aside first."""
    def decide():
        notes = [f"warning: the checkpoint of step {step} in {ckpt.directory} is "
                 f"incomplete (no completion marker): moved aside to "
                 f"{ckpt.set_aside(step, 'damaged')}" for step in ckpt.incomplete_steps()]
        ckpt.reload()
        point = resume_point(train, ckpt)
        newer = [s for s in ckpt.complete_steps()
                 if point is not None and s > point[1] and point != (ckpt.directory, s)]
        if newer:
            moved = [ckpt.set_aside(s, "superseded") for s in newer]
            notes.append(f"train.resume_from={train.resume_from} wins over this run's "
                         f"own newer checkpoints: moved aside to {', '.join(moved)}")
        return point, notes

    point, notes = _decided_by_process_0(primary, decide)
    ckpt.reload()
    return point, notes


def fall_back(train: TrainConfig, ckpt: Checkpointer, err: DamagedCheckpoint,
              primary: bool) -> tuple[Point | None, list[str]]:
    """After `err`: (the next checkpoint to try or None for step 0, lines to print)."""
    def decide():
        named = train.resume_from and locate(train.resume_from)
        if named and named.step is not None and (named.folder, named.step) == (err.directory,
                                                                               err.step):
            raise ConfigError(f"train.resume_from={train.resume_from}: {err}; name "
                              f"another step, or the folder for its newest intact one")
        if err.directory == ckpt.directory:
            moved = ckpt.set_aside(err.step, "damaged")
            ckpt.reload()
            point = resume_point(train, ckpt)
            then = (f"trying step {point[1]}" if point else "no intact checkpoint left: "
                    "starting from step 0")
            return point, [f"warning: {err}; moved aside to {moved}, {then}"]
        return _older_elsewhere(train, err)

    point, notes = _decided_by_process_0(primary, decide)
    ckpt.reload()
    return point, notes


def _older_elsewhere(train: TrainConfig, err: DamagedCheckpoint):
    other = Checkpointer(err.directory, read_only=True)
    try:
        older = [s for s in other.complete_steps() if s < err.step]
    finally:
        other.close()
    if not older:
        raise ConfigError(f"train.resume_from={train.resume_from}: {err}, and "
                          f"there is no older checkpoint there")
    return (err.directory, older[-1]), [
        f"warning: {err} (left in place: not this run's folder); trying step {older[-1]}"]


def check_same_model(model: ModelConfig, ckpt: Checkpointer, point: Point) -> dict:
    """The checkpoint's metadata; ConfigError if the checkpoint at `point` holds another
    model's shape; DamagedCheckpoint if its metadata cannot be read."""
    folder, step = point
    reader = ckpt if folder == ckpt.directory else Checkpointer(folder, read_only=True)
    try:
        meta = dict(reader.metadata(step), dtypes=reader.saved_dtypes(step))
        saved = meta.get("model", {})
    except Exception as err:
        raise DamagedCheckpoint(folder, step, f"its metadata: {short_reason(err)}") from None
    finally:
        if reader is not ckpt:
            reader.close()
    mine = dataclasses.asdict(model)
    differ = [f"model.{k}={saved[k]} there, {mine[k]} here" for k in MODEL_SHAPE_KEYS
              if k in saved and saved[k] != mine[k]]
    if not differ and "d_model" in saved:
        theirs = model_config_from_dict(saved)
        differ = [f"{said} {getattr(theirs, k)} there, {getattr(model, k)} here"
                  for k, said in FAMILY_SHAPE_KEYS.items()
                  if getattr(theirs, k) != getattr(model, k)]
    if differ:
        raise ConfigError(f"the checkpoint of step {step} in {folder} is of another model "
                          f"({'; '.join(differ)}): use its model settings, or another "
                          f"output folder (hydra.run.dir=...) to start this model afresh")
    return meta


def what_changed(meta: dict, engine: Engine, train: TrainConfig) -> str:
    """What a resume changes, in words: the layout (resharded), what the model computes
    (MATHS_KEYS), the stored dtype and the length of the learning-rate schedule."""
    changes = []
    here = mesh_name(engine.parallel)
    if meta.get("layout") and meta["layout"] != here:
        changes.append(f"saved on {meta['layout']}, resharded to {here}")
    if meta.get("model", {}).get("d_model"):
        theirs = model_config_from_dict(meta["model"])
        changes += [f"{said} was {getattr(theirs, k)}, now {getattr(engine.model, k)}"
                    for k, said in MATHS_KEYS.items()
                    if getattr(theirs, k) != getattr(engine.model, k)]
    changes += _casts(meta.get("dtypes") or {}, engine)
    if meta.get("train_steps") and meta["train_steps"] != train.steps:
        changes.append(f"train.steps was {meta['train_steps']}, now {train.steps}: the "
                       f"learning-rate schedule spans {train.steps} steps from here on")
    return f" ({'; '.join(changes)})" if changes else ""


def _casts(saved: dict, engine: Engine) -> list[str]:
    """The dtypes a restore casts (saved -> this run's), in words: the parameters
    (optim.param_dtype) and the optimizer's state (optim.mu_dtype), one line each."""
    if not saved:  # older checkpoints: read in the run's own dtypes
        return []
    here = integrity.dtypes(to_nested(engine.layout.abstract_canonical()))
    said = {}
    for key, dtype in sorted(here.items(), key=lambda kv: not kv[0].startswith("params/")):
        if saved.get(key, dtype) != dtype:
            what = ("parameters", "optim.param_dtype") if key.startswith("params/") else (
                "optimizer moments", "optim.mu_dtype")
            said.setdefault(what, (saved[key], dtype))
    return [f"{what} saved in {was}, cast to {now} ({setting})"
            for (what, setting), (was, now) in said.items()]


# --- The state -------------------------------------------------------------------------

def restore(point: Point, own: Checkpointer, engine: Engine):
    """The train state saved at `point`, laid out for `engine` (DamagedCheckpoint if it
    is not what was saved)."""
    folder, step = point
    if folder == own.directory:
        return own.restore(engine.layout, step)
    other = Checkpointer(folder, read_only=True)
    try:
        return other.restore(engine.layout, step)
    finally:
        other.close()


def fresh_state(model: ModelConfig, train: TrainConfig, engine: Engine, multi: bool):
    """Step 0: the weights of train.init_from, or fresh ones from train.seed."""
    if train.init_from:
        layout = engine.layout
        canonical = hf.load_params(train.init_from, model,
                                   layout.canonical_shardings["params"])
        return layout.init(layout.from_canonical(canonical))
    # One jitted init (cacheable) instead of hundreds of small eager compilations.
    params = jax.jit(partial(spec_of(model).init_params, model))(jax.random.key(train.seed))
    if multi:  # each process places its own shards from the (identical) host copy
        params = jax.device_get(params)
    return engine.init_state(params)


def start_state(model: ModelConfig, train: TrainConfig, engine: Engine, ckpt: Checkpointer,
                devset, records: dict | None = None) -> tuple[dict, Point | None]:
    """(the state this run starts from, the checkpoint it came from or None). `records`:
    what this run's checkpoints record (its optim.name and tokenizer are checked against
    the checkpoint's: `other_optimizer`, `check_same_tokenizer`). A
    checkpoint that turns out damaged is reported in one line and the next one tried;
    the lines go to stderr, the choice to stdout."""
    primary, records = devset.process_index == 0, records or {}

    def say(lines, stream=None):
        for line in lines if primary else ():
            print(line, file=stream or sys.stdout, flush=True)

    point, notes = start_point(train, ckpt, primary)
    say([n for n in notes if n.startswith("warning:")], sys.stderr)
    say([n for n in notes if not n.startswith("warning:")])
    while point is not None:
        try:
            meta = check_same_model(model, ckpt, point)
            check_same_tokenizer(meta, records, point)
            other = other_optimizer(meta, engine, train, point, records.get("optim", "adamw"))
            state = restore_weights(point, ckpt, engine) if other else \
                restore(point, ckpt, engine)
            say([f"resuming from the checkpoint of step {point[1]} in {point[0]}"
                 f"{what_changed(meta, engine, train)}" + (
                     f"; the state of {other} is not kept: optim.name={records.get('optim')} "
                     f"starts afresh (train.reset_optimizer=true)" if other else "")])
            return state, point
        except DamagedCheckpoint as err:
            point, notes = fall_back(train, ckpt, err, primary)
            say(notes, sys.stderr)
    return fresh_state(model, train, engine, devset.process_count > 1), None
