"""AdamW (Loshchilov & Hutter 2019) with linear warmup, a learning-rate schedule and
global-norm clipping. The optimizer state mirrors the parameter tree, so it takes the
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
RMSNorm scales (decaying a gain pulls it towards 0, not towards "no effect"), to the
embedding table unless `optim.decay_embeddings=false` (default true, as in both), and
never to the parameters `optim.no_decay`'s patterns name. The mask is read from
parameter names, so it holds for the canonical and the train (stage) layouts alike.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import jax
import jax.numpy as jnp
import optax

from framework.config import OptimConfig

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
    `head/norm/scale`), not `embed/table` unless decay_embeddings, and not the paths
    `no_decay`'s shell patterns match (the train layout's `stages` read as `layers`)."""
    def decayed(path, _):
        names = [str(getattr(k, "key", k)) for k in path]
        if any(n == "norm" or n.endswith("_norm") for n in names):
            return False
        name = "/".join(["layers" if names[0] == "stages" else names[0]] + names[1:])
        if any(fnmatchcase(name, pattern) for pattern in no_decay):
            return False
        return decay_embeddings or names[:1] != ["embed"]

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                             eps=cfg.eps, weight_decay=cfg.weight_decay,
                             mu_dtype=jnp.dtype(cfg.mu_dtype),
                             mask=lambda p: decay_mask(p, cfg.decay_embeddings, cfg.no_decay)))
    return optax.chain(*parts)
