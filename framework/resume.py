"""Where a run starts: which checkpoint, what is moved aside, what happens when the
chosen one turns out damaged.

Process 0 decides and alone moves step folders (nothing is ever deleted); the other
processes follow its answer (`distributed.agree`) and re-read the folder.

    step folders missing a completion marker   moved aside as <step>.damaged at the start
                                               (so that step can be saved again)
    train.resume_from wins over the run's own  the own checkpoints newer than the start
    checkpoints (framework/checkpoint.py)      step are moved aside as <step>.superseded
    the checkpoint to restore is damaged       own folder: moved aside as <step>.damaged,
    (DamagedCheckpoint)                        the rules applied again (the previous
                                               checkpoint, else resume_from, else step 0);
                                               another run's folder (resume_from): left in
                                               place, the previous step there is used;
                                               a step named explicitly: a one-line error
"""

from __future__ import annotations

import dataclasses

from framework import checkpoint as ckpt_lib
from framework import distributed
from framework.checkpoint import Checkpointer, DamagedCheckpoint
from framework.config import ConfigError, RunConfig

Point = tuple[str, int]  # (checkpoint folder, step)
# Model settings a checkpoint must share with the run restoring it (dtype is only the
# compute dtype: parameters are float32 whatever it is).
MODEL_SHAPE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                    "tie_embeddings")


def _as_point(value) -> Point | None:
    return None if value is None else (str(value[0]), int(value[1]))


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
    return _as_point(point), notes


def start_point(cfg: RunConfig, ckpt: Checkpointer, primary: bool) -> tuple[Point | None,
                                                                           list[str]]:
    """(the checkpoint to start from or None, lines to print). Incomplete step folders
    and, when train.resume_from wins, newer own checkpoints are moved aside first."""
    def decide():
        notes = [f"warning: the checkpoint of step {step} in {ckpt.directory} is "
                 f"incomplete (no completion marker): moved aside to "
                 f"{ckpt.set_aside(step, 'damaged')}" for step in ckpt.incomplete_steps()]
        ckpt.reload()
        point = ckpt_lib.resume_point(cfg.train, ckpt)
        newer = [s for s in ckpt.complete_steps()
                 if point is not None and s > point[1] and point != (ckpt.directory, s)]
        if newer:
            moved = [ckpt.set_aside(s, "superseded") for s in newer]
            notes.append(f"train.resume_from={cfg.train.resume_from} wins over this run's "
                         f"own newer checkpoints: moved aside to {', '.join(moved)}")
        return point, notes

    point, notes = _decided_by_process_0(primary, decide)
    ckpt.reload()
    return point, notes


def fall_back(cfg: RunConfig, ckpt: Checkpointer, err: DamagedCheckpoint,
              primary: bool) -> tuple[Point | None, list[str]]:
    """After `err`: (the next checkpoint to try or None for step 0, lines to print)."""
    def decide():
        named = cfg.train.resume_from and ckpt_lib.locate(cfg.train.resume_from)
        if named and named[1] is not None and (named[0], named[1]) == (err.directory,
                                                                       err.step):
            raise ConfigError(f"train.resume_from={cfg.train.resume_from}: {err}; name "
                              f"another step, or the folder for its newest intact one")
        if err.directory == ckpt.directory:
            moved = ckpt.set_aside(err.step, "damaged")
            ckpt.reload()
            point = ckpt_lib.resume_point(cfg.train, ckpt)
            then = (f"trying step {point[1]}" if point else "no intact checkpoint left: "
                    "starting from step 0")
            return point, [f"warning: {err}; moved aside to {moved}, {then}"]
        other = Checkpointer(err.directory, read_only=True)
        try:
            older = [s for s in other.complete_steps() if s < err.step]
        finally:
            other.close()
        if not older:
            raise ConfigError(f"train.resume_from={cfg.train.resume_from}: {err}, and "
                              f"there is no older checkpoint there")
        return (err.directory, older[-1]), [
            f"warning: {err} (left in place: not this run's folder); trying step "
            f"{older[-1]}"]

    point, notes = _decided_by_process_0(primary, decide)
    ckpt.reload()
    return point, notes


def check_model(cfg: RunConfig, ckpt: Checkpointer, point: Point) -> None:
    """ConfigError if the checkpoint at `point` holds another model's shape;
    DamagedCheckpoint if its metadata cannot be read."""
    folder, step = point
    reader = ckpt if folder == ckpt.directory else Checkpointer(folder, read_only=True)
    try:
        saved = reader.metadata(step).get("model", {})
    except Exception as err:
        from framework.checkpoint_integrity import short_reason

        raise DamagedCheckpoint(folder, step, f"its metadata: {short_reason(err)}") from None
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


def lineage(cfg: RunConfig, ckpt: Checkpointer, point: Point | None) -> str | None:
    """What this run's checkpoints record as the train.resume_from their chain started
    from: the setting if given; else the one of the own checkpoint it continues."""
    if cfg.train.resume_from:
        return ckpt_lib.lineage(cfg.train)
    if point is not None and point[0] == ckpt.directory:
        try:
            return ckpt.metadata(point[1]).get("resume_from")
        except Exception:
            return None
    return None
