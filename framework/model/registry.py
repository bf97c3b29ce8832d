"""The model registry: each architecture hands the engine and the analyses its parts,
so that nothing outside this package imports a model class by name.

    spec = spec_of(model)          # model: ModelConfig; its family's architecture
    spec.init_params(model, key)   canonical parameters {embed, layers, head}
    spec.logical_axes(model)       their logical axis names (the sharding rules' input)
    spec.embed(model, tp) / spec.head(model, tp) / spec.block(model, tp): modules
    spec.apply_layers(...)         a stack of layers under scan (the pipeline's stage)
    spec.head_loss(model, tp, head, table, y, targets, z_loss): the head's token
                                   cross-entropy sum (model.loss_chunk: chunked)
    spec.weight_ops                what the zero-bubble split backward replays
    spec.count_params(model), spec.layer_matrix_params(model), spec.keys_per_query(...)
    spec.check(model)              problems of the model's own shape

A family (`model.family`) is a record of framework/config/model.py naming its
architecture; the families of today (Llama, Qwen2/3, Mistral, Gemma 2) are settings of
one decoder (framework/model/llama.py). A new architecture (a mixture of experts, MLA)
is a module of this package and one `ModelSpec` below; the engine's stage functions,
the memory model's residual trace and the FLOP count then read its parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from framework.config import FAMILIES, ModelConfig
from framework.model import layers, llama, stack


@dataclass(frozen=True)
class WeightOps:
    """The split backward's view of a layer (framework/engine/split.py): the layer's
    module, the collections its weight ops record into (SAVED inputs, TAPS output
    gradients), the replay of its weight ops on saved inputs, the weights that bypass
    them, and the layer scan and sliding windows its stage runs with."""

    block: Callable
    saved: str
    taps: str
    replay: Callable
    outside: Callable
    scan_layers: Callable
    one_layer: Callable  # one step of scan_layers's loop (a layer loop of one's own)
    layer_windows: Callable
    split_windows: Callable


@dataclass(frozen=True)
class ModelSpec:
    name: str
    init_params: Callable
    logical_axes: Callable
    embed: Callable  # (model, tp) -> the embedding module
    head: Callable  # (model, tp) -> final norm + LM head
    block: Callable  # (model, tp) -> one layer
    apply_layers: Callable  # (model, layers, x, stack, n_real, docs, first, scan)
    apply_layers_cached: Callable  # decoding with a KV cache
    kv_cache: Callable  # the cache's type
    head_loss: Callable  # (model, tp, head, table, y, targets, z_loss) -> sum
    checkpointed: Callable  # a layer under a remat policy, FSDP's gather first
    stack: Callable  # how a stage runs its layers (remat, tp, skip, gather)
    weight_ops: WeightOps
    count_params: Callable
    layer_matrix_params: Callable
    keys_per_query: Callable
    check: Callable


DECODER = ModelSpec(
    "decoder", llama.init_params, llama.param_logical_axes, llama.Embed, llama.Head,
    llama.Block, stack.apply_layers, stack.apply_layers_cached, llama.KVCache,
    llama.head_loss, stack.checkpointed, stack.Stack,
    WeightOps(llama.Block, llama.SAVED, llama.TAPS, llama.replay_weight_ops,
              llama.weights_outside_weight_op, stack.scan_layers, stack.one_layer,
              layers.layer_windows, layers.split_windows),
    llama.count_params, llama.layer_matrix_params, llama.keys_per_query, llama.check_model)

ARCHITECTURES: dict[str, ModelSpec] = {"decoder": DECODER}


def spec_of(model: ModelConfig) -> ModelSpec:
    """The parts of `model.family`'s architecture (an unknown family: the decoder, whose
    `check` then names the setting)."""
    family = FAMILIES.get(model.family)
    return ARCHITECTURES[family.architecture if family else "decoder"]
