"""What one layer's backward keeps from its forward, per device, traced (never run)
with the engine's own layers and tensor-parallel plan: the memory model's activation
terms (`framework/analysis/memory_model.py`) read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, PartitionSpec as P

from framework.config import ModelConfig
from framework.engine.split import split_layers
from framework.model import attention
from framework.model.registry import spec_of
from framework.parallel.mesh import EXPERT, TENSOR
from framework.parallel.pipeline.comm import varying
from framework.parallel.pipeline.stage import split_vjp
from framework.parallel.tensor import TensorParallel
from framework.units import tree_bytes as nbytes


@lru_cache(maxsize=None)
def _residual_bytes(model: ModelConfig, tp_plan: TensorParallel, seq: int, remat: str,
                    n_layers: int, rows: int, part: str = "full") -> int:
    """VJP residual bytes of `n_layers` layers for `rows` token rows on one device,
    traced with `jax.eval_shape` (never run): the engine's own `apply_layers` and
    tensor-parallel plan `tp_plan` (its degree, sequence parallelism, collective
    matmul, rules and expert plan: the whole plan is the cache key), inside a shard_map
    over an abstract `tensor` mesh (and `expert` beside it, for the MoE layers'
    dispatch buffers), so weights and activations have their per-device shapes.
    `part`: "full" (the VJP of weights and input, what a fused backward keeps), or for
    a split backward (`framework/engine/split.py`) "input" (the input-gradient VJP's
    residuals), "saved" (the weight ops' inputs) or "douts" (the weight ops' output
    gradients). `seq`, `remat`: the sequence and remat policy the layers run with."""
    tp, sp, expert = tp_plan.size, tp_plan.sequence_parallel, tp_plan.expert.size
    axes = (EXPERT, TENSOR) if expert > 1 else (TENSOR,)
    dt, spec = jnp.dtype(model.dtype), spec_of(model)
    found = {}

    def chunk_residuals():  # runs per device, at trace time only
        over = ((TENSOR,) if sp else ()) + ((EXPERT,) if expert > 1 else ())
        vary = lambda a: varying(a, over)
        x = vary(jnp.zeros((rows, seq // tp if sp else seq, model.d_model), dt))
        keys = jax.random.split(jax.random.key(0), n_layers)
        init = lambda k: nn.meta.unbox(spec.block(model, tp_plan).init(k, x[:1])["params"])
        weights = jax.tree.map(vary, jax.vmap(init)(keys))  # as the engine types them
        if part == "full":
            run = spec.stack(remat, tp_plan)
            _, vjp_fn = jax.vjp(lambda w, x: spec.apply_layers(model, w, x, run), weights, x)
        else:
            y, vjp_fn, saved = split_layers(model, remat, tp=tp_plan).forward(weights, x)
            if part != "input":
                found["bytes"] = nbytes(saved if part == "saved" else vjp_fn(y)[1])
                return jnp.zeros(())
        # The residual leaves, without the weights the VJP closes over (the split the
        # tick executor makes for its stash, framework/parallel/pipeline/ticks.py).
        found["bytes"] = nbytes(split_vjp(vjp_fn, weights)[0])
        return jnp.zeros(())

    mesh = AbstractMesh((expert, tp) if expert > 1 else (tp,), axes)
    jax.eval_shape(jax.shard_map(chunk_residuals, mesh=mesh, in_specs=(), out_specs=P()))
    return found["bytes"]


@dataclass(frozen=True)
class Residuals:
    """What one layer's backward keeps from its forward, per device: a part per token
    row (activations) and a part per layer (e.g. bfloat16 casts of its weights)."""

    per_row: int
    per_layer: int

    def chunk(self, n_layers: int, rows: int) -> int:
        return n_layers * (rows * self.per_row + self.per_layer)


def attention_traced(model: ModelConfig, seq: int, platform: str | None = None) -> ModelConfig:
    """The model with the attention kernel whose memory is predicted: `auto` resolved for
    `platform` (default: JAX's default backend), cudnn as blockwise (see the module
    docstring)."""
    impl = model.attention
    if impl == "auto":
        impl = attention.choose(platform or jax.default_backend(), model.dtype, seq,
                                model.head_dim)
    return dataclasses.replace(model, attention="blockwise" if impl == "cudnn" else impl)


def residuals(model: ModelConfig, seq: int, tp_plan: TensorParallel, remat: str,
              part: str = "full") -> Residuals:
    """Four traces, (layers, rows) in {1, 2}^2, of r(L, b) = L*(b*x + y) + b*z + w. The
    layer-invariant z, w (the causal mask and other broadcast constants, which the
    layer scan hoists and XLA folds into their users) are not memory: dropped.
    `model.attention` must be resolved (`attention_traced`)."""
    r = {(n, b): _residual_bytes(model, tp_plan, seq, remat, n, b, part)
         for n in (1, 2) for b in (1, 2)}
    per_row = r[2, 2] - r[2, 1] - r[1, 2] + r[1, 1]
    return Residuals(per_row, r[2, 1] - r[1, 1] - per_row)
