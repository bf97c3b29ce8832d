"""What a resume may find changed besides the model (framework/run/start.py checks the
model's shape): the optimizer, whose state a checkpoint of another `optim.name` cannot
give (`train.reset_optimizer=true` keeps its weights and step and starts the optimizer
afresh: docs/checkpoints-and-faults.md), and the data's tokenizer, whose ids a
checkpoint's weights were trained on."""

from __future__ import annotations

import jax

from framework.config import TrainConfig
from framework.engine.build import Engine
from framework.errors import ConfigError
from framework.io.checkpoint import integrity
from framework.io.checkpoint.manager import Checkpointer, to_nested

Point = tuple[str, int]  # (checkpoint folder, step)


def _opt_keys(dtypes: dict) -> set[str]:
    return {k for k in dtypes if k.startswith("opt_state/")}


def other_optimizer(meta: dict, engine: Engine, train: TrainConfig, point: Point,
                    mine: str) -> str | None:
    """None when the checkpoint's optimizer state is this run's (optim.name `mine`): the
    same name recorded, the same arrays kept; else, with train.reset_optimizer=true,
    the saved optimizer in words (its state is dropped); ConfigError (one line) without."""
    here = integrity.dtypes(to_nested(engine.layout.abstract_canonical()))
    saved = meta.get("dtypes") or {}
    theirs = meta.get("optim")
    if not saved or (_opt_keys(saved) == _opt_keys(here) and theirs in (None, mine)):
        return None
    said = f"optim.name={theirs}" if theirs else "another optimizer"
    if not train.reset_optimizer:
        raise ConfigError(f"the checkpoint of step {point[1]} in {point[0]} holds the state "
                          f"of {said}, and this run uses optim.name={mine}: set "
                          f"train.reset_optimizer=true to keep its weights and step and "
                          f"start {mine} afresh, or resume with {said}")
    return said


def check_same_tokenizer(meta: dict, records: dict, point: Point) -> None:
    """ConfigError (one line) when the checkpoint was trained on ids of another
    tokenizer than this run's data ("bytes" or a tokenizer.json's SHA-256; either
    unknown: not checked)."""
    theirs, mine = meta.get("tokenizer_sha256"), records.get("tokenizer_sha256")
    if theirs and mine and theirs != mine:
        said = lambda t: "byte-level" if t == "bytes" else f"tokenizer {t[:12]}"
        raise ConfigError(f"the checkpoint of step {point[1]} in {point[0]} was trained on "
                          f"{said(theirs)} ids, this run's data is {said(mine)}: its token "
                          f"ids mean other text; prepare the data with the checkpoint's "
                          f"tokenizer, or start afresh in another folder (hydra.run.dir)")


def restore_weights(point: Point, own: Checkpointer, engine: Engine):
    """The parameters and step saved at `point`, with this engine's optimizer state
    started afresh (train.reset_optimizer)."""
    folder, step = point
    layout = engine.layout
    shapes = layout.abstract_canonical()["params"]
    reader = own if folder == own.directory else Checkpointer(folder, read_only=True)
    try:
        params = reader.restore_params(step, shapes)
    finally:
        if reader is not own:
            reader.close()
    state = layout.init(layout.from_canonical(params))
    state["step"] = jax.device_put(jax.numpy.asarray(step, state["step"].dtype),
                                   state["step"].sharding)
    return state
