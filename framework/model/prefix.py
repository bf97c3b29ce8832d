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
over `data` like any weight, FSDP gathering them layer by layer as it gathers the stack's
layers: `engine/step.py`'s "prefix" gather), the first stage runs k more layers (the stage balance
counts them: `first_cost`), and generation keeps a KV cache for them as for the stack.

The layer stack then holds the L - k MoE layers (`stack_layers`), and layer i of the
stack is global layer k + i (its sliding window, `layers.layer_windows`) - with
model.moe.every 1; with k' > 1, unit i holds layers k + i k' .. k + (i + 1) k' - 1 (below).

MoE every k-th layer (`model.moe.every` k: Qwen's decoder_sparse_step, Llama 4's
interleave_moe_layer_step): after the prefix, each group of k layers ends with the MoE
one (layer i is MoE iff i >= first_dense and (i - first_dense + 1) % k == 0; Qwen's
(i + 1) % k == 0 where first_dense is a multiple of k). The stages still scan one
structure: the stacked *unit* is such a group (`llama.Block`: its k - 1 dense layers as
submodules `dense_0`.., then its own MoE layer), so the stack holds (L - first_dense) / k
units and `parallel.stage_layers` counts units.
"""

from __future__ import annotations

import dataclasses

from framework.config import ModelConfig, MoeConfig

DENSE = "dense"  # embed/dense: the dense prefix's stacked params
UNIT_DENSE = "dense_{}"  # layers/dense_<j>: a unit's j-th dense layer (model.moe.every)
# its training FLOPs over a layer's without remat: its backward recomputes its forward
# (3 forwards' worth + 1)
RECOMPUTED = 4 / 3


def prefix_layers(cfg: ModelConfig) -> int:
    """How many dense layers come before the MoE layers (0 for a dense model)."""
    return cfg.moe.first_dense if cfg.moe.enabled else 0


def unit_layers(cfg: ModelConfig) -> int:
    """Decoder layers per stacked unit: model.moe.every (1 for a dense model)."""
    return cfg.moe.every if cfg.moe.enabled else 1


def stack_layers(cfg: ModelConfig) -> int:
    """The units the pipeline's stages hold (all but the dense prefix, `unit_layers` a
    unit; with every 1 a unit is a layer)."""
    return (cfg.n_layers - prefix_layers(cfg)) // unit_layers(cfg)


def stacked_layers_named(cfg: ModelConfig) -> str:
    """`stack_layers` in the settings' words, for messages."""
    L, k, every = stack_layers(cfg), prefix_layers(cfg), unit_layers(cfg)
    if L == cfg.n_layers:
        return f"model.n_layers={L}"
    held = "model.n_layers - model.moe.first_dense" if k else "model.n_layers"
    return f"{held}={L}" if every == 1 else f"({held}) / model.moe.every={L} units"


def unit_stacks(cfg: ModelConfig) -> list[tuple[tuple[str, ...], ModelConfig, int, int, int]]:
    """The stacked layer trees as global layers: [(path of the tree, its layers' model,
    how many, the global index of its first layer, the stride between its layers)] -
    the stack's own (MoE) layers, a unit's dense layers, the prefix. HF import and
    export read it."""
    k, every, n = prefix_layers(cfg), unit_layers(cfg), stack_layers(cfg)
    out = [(("layers",), cfg, n, k + every - 1, every)]
    out += [(("layers", UNIT_DENSE.format(j)), dense_config(cfg, in_unit=True), n, k + j,
             every)
            for j in range(every - 1)]
    return out + ([(("embed", DENSE), dense_config(cfg), k, 0, 1)] if k else [])


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    """Whether global layer i is a mixture of experts (module docstring)."""
    k = prefix_layers(cfg)
    return cfg.moe.enabled and i >= k and (i - k + 1) % unit_layers(cfg) == 0


def moe_layer_index(cfg: ModelConfig, unit: int) -> int:
    """The global index of the MoE layer of stacked unit `unit` (the unit's last)."""
    return prefix_layers(cfg) + (unit + 1) * unit_layers(cfg) - 1


def dense_config(cfg: ModelConfig, in_unit: bool = False) -> ModelConfig:
    """The model as its dense layers see it: the gated MLP model.d_ff wide. The dense
    prefix's in the compute dtype with `model.fp8` (like the embedding it runs beside:
    the prefix has no FP8 probes, so delayed scaling's histories could not fill there);
    a unit's (`in_unit`: model.moe.every) with the model's FP8, as the stacked layers
    they are (quantized once a step and gathered as E4M3 with them, probed with them)."""
    return dataclasses.replace(cfg, moe=MoeConfig(), n_layers=prefix_layers(cfg),
                               fp8=cfg.fp8 if in_unit else "none")


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
