"""AdamW (Loshchilov & Hutter 2019) with linear warmup, cosine decay and global-norm
clipping. The optimizer state mirrors the parameter tree, so it takes the parameters'
shardings (or, with ZeRO-1, the data-sharded ones) without extra code."""

from __future__ import annotations

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


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                             eps=cfg.eps, weight_decay=cfg.weight_decay))
    return optax.chain(*parts)
