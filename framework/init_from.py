"""`train.init_from=<Hugging Face Llama folder>`: train from published weights.

The model settings come from the folder's config.json (framework/hf.py); a `model.*`
value that the user or the recipe set and that contradicts it stops the run with one
line naming both (the compute dtype, `model.dtype`, is the run's own choice). The
weights are then placed directly on the run's layout: every canonical leaf with the
sharding a checkpoint restore would give it (`canonical_shardings`: tensor-sharded
dims, `layers` over `pipe`), each process reading only its devices' blocks, then one
jitted relayout into the engine's train layout and a fresh optimizer state. The run
starts at step 0.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from framework import hf
from framework.checkpoint_layout import canonical_shardings
from framework.config import ConfigError, RunConfig
from framework.pipeline import layout
from framework.safetensors_io import Tensors


def resolve(cfg: RunConfig, model_given=None) -> tuple[RunConfig, dict | None]:
    """(cfg with the folder's model settings, the folder's config.json), or (cfg, None)
    without train.init_from. model_given: names of the model.* settings set explicitly
    (on the command line or by the recipe); None: every one counts as set."""
    folder = cfg.train.init_from
    if not folder:
        return cfg, None
    if cfg.train.resume_from:
        raise ConfigError(f"train.init_from={folder} and train.resume_from="
                          f"{cfg.train.resume_from} both say where to start: set one")
    folder = os.path.abspath(os.path.expanduser(folder))
    if not os.path.isdir(folder):
        raise ConfigError(f"train.init_from={cfg.train.init_from} is not a folder")
    where = os.path.join(folder, hf.CONFIG_FILE)
    config = hf.read_config(folder)
    names = [f.name for f in dataclasses.fields(cfg.model)] if model_given is None else model_given
    given = {k: getattr(cfg.model, k) for k in names}
    model = hf.merge_model(given, hf.model_config(config, where, cfg.model.dtype), where)
    hf.check_tensors(Tensors(folder), model, folder)  # before anything compiles
    train = dataclasses.replace(cfg.train, init_from=folder)
    return dataclasses.replace(cfg, model=model, train=train), config


def initial_state(engine, folder: str):
    """The train state {params, opt_state, step=0} on `engine`'s layout, from the
    folder's weights."""
    canonical = hf.load_params(folder, engine.model, canonical_shardings(engine)["params"])
    to_train = jax.jit(
        lambda c: layout.canonical_to_train(c, engine.parallel.pipeline, engine.n_chunks),
        out_shardings=engine.state_shardings["params"])
    init = lambda p: {"params": p, "opt_state": engine.optimizer.init(p),
                      "step": jnp.zeros((), jnp.int32)}
    return jax.jit(init, out_shardings=engine.state_shardings)(to_train(canonical))
