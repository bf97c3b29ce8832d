"""Dense layers before the mixtures of experts (`model.moe.first_dense` k: DeepSeek-V3's
first_k_dense_replace 3, Kimi K2's and Moonlight's 1): layers 0..k-1 keep the dense
gated MLP, the rest are MoE layers.

A stage scans one layer structure, so the k dense layers are not in the layer stack:
they are part of the model's input piece, run right after the embedding on the first
stage, their params stacked under `embed/dense` ([k, ...], Block's dense tree: the
model at `dense_config`). Everything the pipeline does with the embedding it does with
them, unchanged: the first stage computes them in each forward cell, and the backward
recomputes the piece from the token ids and pulls the gradient of the stack's first
input through it (`cells.embed_grad`: the dense prefix is always fully rematerialised,
its only residual the ids); their gradients join the embedding's. What that costs:
every pipeline rank stores them (as it stores the embedding; FSDP and ZeRO-1 shard them
over `data` like any weight), the first stage runs k more layers (the stage balance
counts them: `first_cost`), and generation keeps a KV cache for them as for the stack.

The layer stack then holds the L - k MoE layers (`stack_layers`), and layer i of the
stack is global layer k + i (its sliding window, `layers.layer_windows`).
"""

from __future__ import annotations

import dataclasses

import jax

from framework.config import ModelConfig, MoeConfig

DENSE = "dense"  # embed/dense: the dense prefix's stacked params
# its training FLOPs over a layer's without remat: its backward recomputes its forward
# (3 forwards' worth + 1)
RECOMPUTED = 4 / 3


def prefix_layers(cfg: ModelConfig) -> int:
    """How many dense layers come before the MoE layers (0 for a dense model)."""
    return cfg.moe.first_dense if cfg.moe.enabled else 0


def stack_layers(cfg: ModelConfig) -> int:
    """The layers the pipeline's stages hold: all but the dense prefix."""
    return cfg.n_layers - prefix_layers(cfg)


def dense_config(cfg: ModelConfig) -> ModelConfig:
    """The model as its dense prefix's layers see it: the gated MLP model.d_ff wide."""
    return dataclasses.replace(cfg, moe=MoeConfig(), n_layers=prefix_layers(cfg))


def table_of(embed) -> dict:
    """The embedding module's own params of the input piece's (without the prefix)."""
    return {k: v for k, v in embed.items() if k != DENSE}


def embed_piece(cfg: ModelConfig, tp, embed_module, apply_layers, stack):
    """(embed params, ids [batch, seq], docs) -> the stack's input [batch, seq(/tensor
    with SP), d_model]: the embedding, then the dense prefix under `stack`'s remat,
    tensor plan and gathers (`apply_layers` as `stack.apply_layers`)."""
    dense_cfg, k = dense_config(cfg), prefix_layers(cfg)

    def run(embed, ids, docs=None):
        x = embed_module(cfg, tp).apply({"params": table_of(embed)}, ids)
        if k == 0:
            return x
        return apply_layers(dense_cfg, embed[DENSE], x, stack, docs=docs)

    return run
