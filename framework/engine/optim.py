"""AdamW (Loshchilov & Hutter 2019), or Muon on the layers' matrices, with linear
warmup, a learning-rate schedule and global-norm clipping. The optimizer state mirrors the parameter tree, so it takes the
parameters' shardings (or, with ZeRO-1 and FSDP, the data-sharded ones) without extra
code.

Schedules after the warmup (`optim.schedule`), from `lr` down to `lr * min_lr_ratio`
at the last step: `cosine` (Loshchilov & Hutter 2017), `linear`, `constant` (stays at
`lr`), and `wsd`, warmup-stable-decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024):
constant until the last `decay_steps` (default a fifth of the run), then a decay of
`decay_shape` linear, cosine or sqrt (1 - sqrt of the decay's progress, Hägele et
al.'s best). Because the stable phase does not depend on the run's length, a cooldown
can branch off any checkpoint: resume it with train.steps = its step + decay_steps.

Weight decay applies to the matrices only, as nanoGPT and Megatron-LM do: never to the
biases nor to the RMSNorm scales (decaying a gain pulls it towards 0, not towards "no
effect"), to the embedding table unless `optim.decay_embeddings=false` (default true,
as in both), and never to the parameters `optim.no_decay`'s patterns name. The mask is read from
parameter names, so it holds for the canonical and the train (stage) layouts alike.

`optim.name=muon` (Jordan et al. 2024; optax's `scale_by_muon`): the layers' weight
matrices take Muon's update, the momentum orthogonalised by Newton-Schulz iterations,
each layer (and gate and up) apart, scaled by 0.2 sqrt(max(fan-in, fan-out)) so that
its RMS matches AdamW's and AdamW's learning rate and weight decay carry over (Liu et
al. 2025, "Muon is scalable for LLM training"); the embedding, the head and the norm
scales keep AdamW, as in both. Muon's matrix function needs each whole matrix: on a
sharded layout XLA gathers what the update needs (the optimizer runs outside the
step's shard_map).

Stored dtypes: the parameters and their gradients are `optim.param_dtype` (float32
by default; bfloat16 halves both), the first moment `optim.mu_dtype`, the second
always float32. Whatever the parameters' dtype, the optimizer computes in float32
(`in_float32`): gradients and parameters are widened on the way in, and only the
sum parameter + update is rounded to the stored dtype (optax.apply_updates). With
bfloat16 parameters an update below half a bfloat16 step of its parameter (2^-9 to
2^-8 of it, by its mantissa) is lost: the price of the halved memory, which plain rounding pays
(stochastic rounding, which would keep it on average, is not done).
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase

import jax
import jax.numpy as jnp
import optax

from framework.model import fp8_delayed
from framework.model.prefix import DENSE
from framework.config import OptimConfig

# Muon's (reduction, output) axes of each layer matrix, counted from the last (the
# stacking of stages, chunks and layers in front are batch axes: every layer apart).
MUON_AXES = {
    "wqkv": ((-4,), (-3, -2, -1)),  # [d, kv_heads, q per kv + 2, head_dim]
    "wo": ((-3, -2), (-1,)),  # [heads, head_dim, d]
    "w_gate_up": ((-3,), (-1,)),  # [d, 2, d_ff]: gate and up apart
    "w_down": ((-2,), (-1,)),  # [d_ff, d]
}
MUON_RMS = 0.2  # AdamW's typical update RMS (Liu et al. 2025)
WSD_DECAY_SHARE = 0.2  # wsd without decay_steps: the last fifth of the run
SHAPES = {  # wsd's decay: the share of (lr - end) left at progress f in [0, 1]
    "linear": lambda f: 1 - f,
    "cosine": lambda f: 0.5 * (1 + jnp.cos(jnp.pi * f)),
    "sqrt": lambda f: 1 - jnp.sqrt(f),
}


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate at each step (module docstring)."""
    warmup = max(0, min(cfg.warmup_steps, total_steps))
    peak, end = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup else peak, peak_value=peak, warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1), end_value=end)
    if cfg.schedule == "wsd":
        decay = cfg.decay_steps or max(1, round(WSD_DECAY_SHARE * total_steps))
        start = max(warmup, total_steps - decay)
        shape = SHAPES[cfg.decay_shape]
    else:  # linear from the warmup's end, or constant
        start, decay = warmup, max(1, total_steps - warmup)
        shape = SHAPES["linear"] if cfg.schedule == "linear" else (lambda f: 1.0 + 0 * f)

    def schedule(step):
        ramp = jnp.minimum(1.0, (step + (0 if warmup else 1)) / max(warmup, 1))
        progress = jnp.clip((step - start) / decay, 0.0, 1.0)
        return ramp * (end + (peak - end) * shape(progress))

    return schedule


def decay_mask(params, decay_embeddings: bool = True, no_decay: tuple[str, ...] = ()):
    """True for the parameters AdamW decays: not the norm scales (`*_norm/scale`,
    `head/norm/scale`), not the biases (`*_bias`, as Megatron-LM and nanoGPT), not
    delayed FP8 scaling's histories (`*_fp8_history`, moved by the step only), not
    `embed/table` unless decay_embeddings, and not the paths `no_decay`'s shell
    patterns match (the train layout's `stages` read as `layers`)."""
    def decayed(path, _):
        names = [str(getattr(k, "key", k)) for k in path]
        if any(n == "norm" or n.endswith(("_norm", "_bias")) for n in names) or \
                fp8_delayed.is_history(path):  # (FP8 scaling's statistics: no weights)
            return False
        name = "/".join(["layers" if names[0] == "stages" else names[0]] + names[1:])
        if any(fnmatchcase(name, pattern) for pattern in no_decay):
            return False
        return decay_embeddings or names[:2] != ["embed", "table"]

    return jax.tree_util.tree_map_with_path(decayed, params)


def muon_axes(params):
    """Per leaf: Muon's MuonDimensionNumbers for a layer matrix, None for AdamW's
    parameters, MaskedNode where optax's partition masked the leaf out."""
    def one(path, leaf):
        if isinstance(leaf, optax.MaskedNode):
            return leaf
        names = [str(getattr(k, "key", k)) for k in path]
        layer = names[0] in ("layers", "stages") or names[:2] == ["embed", DENSE]  # prefix.py
        axes = MUON_AXES.get(names[-1]) if layer else None
        return optax.contrib.MuonDimensionNumbers(*axes) if axes else None

    return jax.tree_util.tree_map_with_path(
        one, params, is_leaf=lambda x: isinstance(x, optax.MaskedNode))


def _muon_rms_scale() -> optax.GradientTransformation:
    """Muon's orthogonal update times 0.2 sqrt(max(fan-in, fan-out)) (Liu et al. 2025)."""
    def scale(updates, state, params=None):
        axes = muon_axes(updates)
        def one(u, dims):
            if dims is None or isinstance(u, optax.MaskedNode):
                return u
            fan = [math.prod(u.shape[a] for a in group) for group in dims]
            return u * (MUON_RMS * math.sqrt(max(fan)))
        return jax.tree.map(one, updates, axes, is_leaf=lambda x: isinstance(
            x, optax.MaskedNode) or x is None), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), scale)


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`inner` fed float32 copies of the gradients and parameters, so its state and its
    updates are float32 whatever the stored dtype (module docstring); a no-op for
    float32 parameters."""
    widen = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)

    def update(updates, state, params=None, **extra):
        return inner.update(widen(updates), state,
                            None if params is None else widen(params), **extra)

    return optax.GradientTransformationExtraArgs(lambda params: inner.init(widen(params)),
                                                 update)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    lr, mask = lr_schedule(cfg, total_steps), (
        lambda p: decay_mask(p, cfg.decay_embeddings, cfg.no_decay))
    adamw = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mu_dtype=jnp.dtype(cfg.mu_dtype), mask=mask)
    if cfg.name == "adamw":
        return in_float32(optax.chain(*parts, adamw))
    muon = optax.chain(
        optax.contrib.scale_by_muon(beta=cfg.muon_momentum, mu_dtype=jnp.dtype(cfg.mu_dtype),
                                    weight_dimension_numbers=muon_axes),
        _muon_rms_scale(),
        optax.add_decayed_weights(cfg.weight_decay, mask),
        optax.scale_by_learning_rate(lr))
    labels = lambda p: jax.tree.map(lambda a: "adam" if a is None else "muon", muon_axes(p),
                                    is_leaf=lambda x: x is None or isinstance(
                                        x, optax.contrib.MuonDimensionNumbers))
    return in_float32(optax.chain(*parts, optax.partition({"muon": muon, "adam": adamw},
                                                          labels)))
