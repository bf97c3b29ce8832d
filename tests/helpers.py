"""Shared fixtures: a tiny model, engines of it on any layout, the single-device
reference's loss and gradients to compare them with, and the repository's paths."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import numpy as np

from framework.config import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from framework.engine.build import build_engine
from framework.engine.optim import make_optimizer
from framework.engine.validate import validate
from framework.engine.state import as_dtype
from framework.model import reference
from framework.model.llama import init_params
from framework.parallel.mesh import make_mesh

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"  # small Hugging Face Llamas written by transformers


def load_tool(name: str):
    """The module of tools/<name>.py (its functions, without running its command line)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compose_recipe(name: str, *overrides: str, config: str = "config"):
    """The RunConfig `python -m framework.run recipe=<name> <overrides>` composes
    (config="compile": the CompileConfig of `python -m framework.compile`)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from framework.run import cli

    cli.register_configs()
    with initialize_config_dir(config_dir=str(cli.CONF_DIR), version_base=None):
        cfg = compose(config, overrides=[f"recipe={name}", *overrides])
    return OmegaConf.to_object(cfg)


# Small enough to compile in seconds, shaped so tensor=4 and pipeline*virtual=8 divide.
MODEL = ModelConfig(vocab_size=128, d_model=64, n_layers=8, n_heads=8, n_kv_heads=4,
                    d_ff=128, dtype="float32")
TRAIN = TrainConfig(seq_len=16, global_batch_size=16, steps=5, seed=0)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, weight_decay=0.1, grad_clip=1.0)


def tokens(step: int, train: TrainConfig = TRAIN, model: ModelConfig = MODEL):
    return reference.tokens_for_step(train.seed, step, train.global_batch_size,
                                     train.seq_len, model.vocab_size)


_PARAMS = {}


def params(model: ModelConfig = MODEL):
    """Initial canonical parameters as host (numpy) arrays (jitted init, cached per
    model: eager Flax init of a stacked model takes seconds on CPU). On the host, an
    engine's relayout of them (`shard_params`) is numpy indexing, not one small XLA
    program compiled per leaf shape: those took ~15% of a parity test's time."""
    if repr(model) not in _PARAMS:
        _PARAMS[repr(model)] = host(jax.jit(lambda key: init_params(model, key))(
            jax.random.key(0)))
    return _PARAMS[repr(model)]


def host(tree):
    """Every array of `tree` as a numpy array (a device array is fetched whole)."""
    return jax.tree.map(np.asarray, tree)


def canonical_of(eng, train_params):
    """An engine's train-layout tree (parameters or gradients) in the canonical layout,
    relaid out on the host (see `params`)."""
    return eng.canonical_params(host(train_params))


def engine(pipeline=1, data=1, tensor=1, microbatches=1, model=MODEL, train=TRAIN,
           optim=OPTIM, documents=None, **parallel_kw):
    par = ParallelConfig(pipeline=pipeline, data=data, tensor=tensor,
                         microbatches=microbatches, **parallel_kw)
    par = validate(model, par, train, par.n_devices)
    return build_engine(model, par, optim, train.steps, make_mesh(par), documents)


def stub_cudnn_checks(monkeypatch) -> None:
    """cuDNN's kernel cannot run here, but its JAX side traces with its GPU checks
    stubbed (skips where this JAX checks cuDNN otherwise)."""
    import pytest

    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not hasattr(fused, "check_cudnn_version"):
        pytest.skip("this JAX checks cuDNN differently")
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused, "check_compute_capability", lambda capability: True)


_REFERENCE = {}


def reference_grads(model=MODEL, step=0):
    """The single-device loss and gradients (computed once per model and step: many
    parity tests compare with the same reference)."""
    key = ("grads", repr(model), step)
    if key not in _REFERENCE:
        _REFERENCE[key] = jax.jit(lambda p, t: reference.loss_and_grads(p, t, model))(
            params(model), tokens(step))
    return _REFERENCE[key]


def reference_losses(n_steps, model=MODEL, optim=OPTIM, train=TRAIN):
    """The single-device losses of `n_steps` optimizer steps and the final parameters
    (computed once per setting)."""
    key = ("losses", n_steps, repr(model), repr(optim), repr(train))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_losses(n_steps, model, optim, train)
    losses, final = _REFERENCE[key]
    return list(losses), final


def _reference_losses(n_steps, model, optim, train):
    opt = make_optimizer(optim, train.steps)
    p = as_dtype(params(model), optim.param_dtype)
    state = opt.init(p)
    step = reference.reference_train_step(model, opt)
    losses = []
    for i in range(n_steps):
        p, state, loss = step(p, state, tokens(i))
        losses.append(float(loss))
    return losses, p


def engine_grads(eng, step=0, optimization_level=None):
    """The engine's loss and canonical gradients; `optimization_level` compiles this
    one program at that XLA:CPU backend level instead of the suite's 0 (conftest.py)."""
    fn = eng.loss_and_grads_fn()
    args = eng.shard_params(params(eng.model)), eng.shard_batch(tokens(step))
    if optimization_level is not None:
        fn = fn.lower(*args).compile(
            compiler_options={"xla_backend_optimization_level": optimization_level})
    loss, grads = fn(*args)
    return float(loss), canonical_of(eng, grads)


def engine_losses(eng, n_steps):
    state = eng.init_state(params(eng.model))
    losses = []
    for i in range(n_steps):
        state, metrics = eng.step(state, eng.shard_batch(tokens(i)))
        losses.append(float(metrics["train/loss"]))
    return losses, canonical_of(eng, state["params"])


def max_rel_err(tree, ref_tree) -> dict:
    """Per leaf: max |a - b| / max |b|."""
    def one(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    return jax.tree.map(one, tree, ref_tree)


def worst(errs: dict) -> float:
    return max(jax.tree.leaves(errs))
