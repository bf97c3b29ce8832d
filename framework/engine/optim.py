"""AdamW (Loshchilov & Hutter 2019) with linear warmup, cosine decay and global-norm
clipping. The optimizer state mirrors the parameter tree, so it takes the parameters'
shardings (or, with ZeRO-1, the data-sharded ones) without extra code.

Weight decay applies to the matrices only, as nanoGPT and Megatron-LM do: never to the
RMSNorm scales (decaying a gain pulls it towards 0, not towards "no effect"), and to
the embedding table unless `optim.decay_embeddings=false` (default true, as in both).
The mask is read from parameter names, so it holds for the canonical and the train
(stage) layouts alike.
"""

from __future__ import annotations

import jax
import optax

from framework.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = max(0, min(cfg.warmup_steps, total_steps))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def decay_mask(params, decay_embeddings: bool = True):
    """True for the parameters AdamW decays: not the norm scales (`*_norm/scale`,
    `head/norm/scale`), and not `embed/table` unless decay_embeddings."""
    def decayed(path, _):
        names = [str(getattr(k, "key", k)) for k in path]
        if any(n == "norm" or n.endswith("_norm") for n in names):
            return False
        return decay_embeddings or names[:1] != ["embed"]

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                             eps=cfg.eps, weight_decay=cfg.weight_decay,
                             mask=lambda p: decay_mask(p, cfg.decay_embeddings)))
    return optax.chain(*parts)
