"""The small layers the decoder (framework/model/llama.py) is built of, and the settings
that vary them between families (framework/config/model.py, FAMILY_PRESETS): RMSNorm, plain
(Llama) or scaled by (1 + w) (Gemma 2), and the gated MLP, SwiGLU (Llama) or GeGLU
with the tanh GELU (Gemma 2). Also which layers attend through a sliding window.

RMSNorm: Zhang & Sennrich 2019. SwiGLU, GeGLU: Shazeer 2020. Gemma 2's forms: Gemma
Team 2024 and transformers' modeling_gemma2.py (Gemma2RMSNorm: `x * (1 + w)` in float32,
then cast; Gemma2MLP: `act(gate) * up` with `gelu_pytorch_tanh`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from framework.model.prefix import prefix_layers, unit_layers
from framework.config import ModelConfig
from framework.model.blockwise import zeros_varying_like
from framework.model.weight_ops import gathered_weight_op, scattered_weight_op, weight_op
from framework.parallel.tensor import TensorParallel

NO_TP = TensorParallel()
init_normal = nn.initializers.normal(stddev=0.02)
# The window of a global layer among local ones (a per-layer window is one traced
# array): wider than any sequence, and far enough from 2^31 that the kernels' block
# bounds (a position plus the window) stay within int32.
NO_WINDOW = 1 << 30
ACTIVATIONS = {"silu": nn.silu,
               "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}  # gelu_pytorch_tanh


def gated(cfg: ModelConfig, gate_up):
    """The gated MLP's hidden activations: gate_up [..., 2, f] (gate, up) -> act(gate) *
    up [..., f] (`model.activation`). The dense MLP, the experts and the shared expert
    (framework/model/moe.py) read this one rule. Recomputed in the backward from gate_up
    (`jax.checkpoint`: elementwise work on an array the down projection reads anyway),
    so autodiff keeps gate_up, not the gate, the up and the activation's intermediates
    (three [..., f] arrays fewer of six; "selective recomputation", Korthikanti et al.
    2022). Without `prevent_cse`: the layers run inside scans (the layer stack, the tick
    loop), which keep the recomputation apart from the forward already, and the barrier
    it would add made the GPU compiler write each layer's gate_up slice out whole before
    the recomputation read it (llama_1b_1gpu: 14 GiB a step, docs/performance.md)."""
    act = ACTIVATIONS[cfg.mlp_activation]
    return jax.checkpoint(lambda gu: act(gu[..., 0, :]) * gu[..., 1, :],
                          prevent_cse=False)(gate_up)


def param(module: nn.Module, name: str, shape, axes, init=init_normal):
    """A float32 weight of global `shape` with logical `axes`; the module's tensor-parallel
    plan makes it this device's shard."""
    shape = getattr(module, "tp", NO_TP).local_shape(shape, axes)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


class RMSNorm(nn.Module):
    """x / rms(x) * w in float32, then cast back; with `plus_one`, * (1 + w) and w
    starting at 0 (Gemma 2). Its backward keeps x and x / rms(x) in float32: a norm
    with its own VJP, or recomputed, kept x alone and passed the float32 parity tests
    but not the FP8 ones (docs/performance.md, "What a layer keeps")."""

    eps: float
    plus_one: bool = False

    @nn.compact
    def __call__(self, x):  # x: [..., embed]
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = param(self, "scale", (x.shape[-1],), ("norm",), init)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # (1 + w) in float32, as transformers' Gemma2RMSNorm (w may be stored in bfloat16)
        scale = 1.0 + scale.astype(jnp.float32) if self.plus_one else scale
        return weight_op(self, "scale", "...d,d->...d", x32, scale).astype(x.dtype)


def norm(cfg: ModelConfig, name: str) -> RMSNorm:
    """The model's RMSNorm, named `name`."""
    return RMSNorm(cfg.norm_eps, cfg.has_norm_plus_one, name=name)


class MLP(nn.Module):
    """Gated feed-forward, act(gate) * up (`model.activation`): gate and up fused in one
    column-parallel weight [embed, 2, mlp] (one backward reduction), row-parallel down
    projection."""

    cfg: ModelConfig
    tp: TensorParallel = NO_TP

    @nn.compact
    def __call__(self, x):  # x: [batch, seq (/tensor with SP), embed]
        c, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        w_in = param(self, "w_gate_up", (c.d_model, 2, c.d_ff), ("embed", "gate_up", "mlp"))
        w_down = param(self, "w_down", (c.d_ff, c.d_model), ("mlp", "embed"))
        gate_up = gathered_weight_op(self, "w_gate_up", "bsd,dcf->bscf", x.astype(dt),
                                     w_in.astype(dt), "mlp")  # [b, s, 2, mlp@tensor]
        return scattered_weight_op(self, "w_down", "bsf,fd->bsd", gated(c, gate_up),
                                   w_down.astype(dt), "mlp")


def layer_windows(cfg: ModelConfig, n: int, first=None):
    """The sliding windows of n consecutive layers of the stack from its layer `first` (an
    int or traced; None: 0): None without a window; an int when every layer has the same
    (sliding_window_pattern 0, Mistral); else [n] int32, NO_WINDOW on the global layers
    (`ModelConfig.global_layer`)."""
    if cfg.sliding_window is None:
        return None
    if not cfg.sliding_window_pattern:
        return cfg.sliding_window
    # the stack's layer i is global layer first_dense + i (the dense prefix: prefix.py;
    # a stacked unit of model.moe.every layers is refused with a window pattern)
    assert unit_layers(cfg) == 1, "model.moe.every > 1 with sliding_window_pattern"
    offset = prefix_layers(cfg)
    index = offset + (0 if first is None else first) + jnp.arange(n, dtype=jnp.int32)
    return jnp.where(cfg.global_layer(index), NO_WINDOW, cfg.sliding_window).astype(jnp.int32)


def split_windows(windows, like):
    """layer_windows' result as (the same for every layer, or None; per layer [n], or
    None): the first is closed over, the second scanned with the layers, typed like the
    activations `like` inside a shard_map (it is a residual of the layers' VJP, which a
    pipeline executor stashes by type)."""
    if windows is None or isinstance(windows, int):
        return windows, None
    return None, windows + zeros_varying_like((), like).astype(jnp.int32)


def softcap(x, cap):
    """cap tanh(x / cap) (Gemma 2's logit soft-capping), or x where cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)
