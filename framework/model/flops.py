"""FLOPs of training one token, the one module that counts them, in named conventions.

Model FLOPs (MFU, throughput, the compile report), PaLM (Chowdhery et al. 2022),
appendix B:

    6 * N  +  12 * L * H * Q * T

6N: every parameter that takes part in a matmul costs 2 FLOPs per token forward and 4
backward (N: all layer weights plus the LM head; the embedding lookup is a gather, not
a matmul; a tied table counts once, as the head). 12*L*H*Q*T: attention scores and the
weighted sum of values (2 matmuls of T x Q per head per token, forward and backward), L
layers, H heads of size Q (`model.head_dim`), T keys per query. Like PaLM this counts the
full T x T score matrix (`FULL_SCORES`), not the causal half, and no recomputation:
*model* FLOPs, so MFU compares layouts and published runs fairly. A layer with a sliding
window w (Mistral, Gemma 2's local layers) counts min(w, T) keys per query.

The other conventions, each named where it is read:
  CAUSAL_SCORES   half the scores, what a causal kernel computes: the stage balance of
                  `parallel.stage_layers=auto` (relative costs of the stages, Kaplan et
                  al. 2020 count the same terms)
  recomputed      what remat adds (hardware FLOPs, the planner's compute time): the
                  layers' forward again under full remat (a third of their training
                  FLOPs); under save_dots the attention's batched dots (scores and
                  weighted values, 4 L H Q T; not saved by the policy); a split backward
                  (zero-bubble) under remat runs the recomputation and the input
                  gradient twice, in B and in W.
"""

from __future__ import annotations

from framework.config import ModelConfig
from framework.model.moe import moe_layers, routed_params
from framework.model.prefix import (RECOMPUTED, dense_config, prefix_layers, stack_layers,
                                    unit_layers)
from framework.model.registry import spec_of

FULL_SCORES, CAUSAL_SCORES = "full", "causal"


def matmul_params(model: ModelConfig) -> int:
    """N of the 6N term: parameters used in matmuls (layers and LM head); of a mixture of
    experts, those a token uses (its top_k experts)."""
    embedding_lookup = 0 if model.tie_embeddings else model.vocab_size * model.d_model
    return spec_of(model).count_params(model, active=True) - embedding_lookup


def attention_flops(model: ModelConfig, seq_len: int, scores: str = FULL_SCORES) -> float:
    """Training FLOPs per token of every layer's scores and weighted values (keys per
    query: seq_len, or the window on local layers); CAUSAL_SCORES: half of them."""
    full = 12 * model.n_heads * model.head_dim * sum(spec_of(model).keys_per_query(model, seq_len))
    return float(full if scores == FULL_SCORES else full / 2)


def head_flops(model: ModelConfig) -> float:
    """Training FLOPs per token of the LM head's projection (the norm and the
    cross-entropy are elementwise)."""
    return float(6 * model.d_model * model.vocab_size)


def model_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one trained token, PaLM appendix B (module docstring)."""
    return float(6 * matmul_params(model) + attention_flops(model, seq_len))


def _unit_and_dense_layer(model: ModelConfig, seq_len: int,
                          expert_rows: float = 1.0) -> tuple[float, float]:
    """Forward FLOPs per token of (a stacked unit, one dense layer): 2 per matmul weight
    and, causal, half the 4 x keys x H x Q of the scores and weighted values (keys
    averaged over the layers). A unit: its layer, and with model.moe.every k its k - 1
    dense ones (prefix.py); its MoE layer's routed experts at `expert_rows` rows per
    routed copy (`hardware_flops_per_token`'s)."""
    spec = spec_of(model)
    keys = sum(spec.keys_per_query(model, seq_len)) / model.n_layers
    scores = 2 * keys * model.n_heads * model.head_dim
    dense_layer = 2 * spec.layer_matrix_params(dense_config(model)) + scores
    unit = 2 * spec.layer_matrix_params(model) + scores + (unit_layers(model) - 1) * dense_layer
    if model.moe.enabled:
        unit += (expert_rows - 1.0) * 2 * routed_params(model)
    return float(unit), float(dense_layer)


def stage_flops_per_token(model: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """(a stacked unit (a layer, or model.moe.every layers), the embedding (a lookup:
    none), the head): the costs the stage balance weighs, attention by CAUSAL_SCORES.
    Training: 3x the forward; a MoE model's dense prefix (prefix.py), in the input
    piece, has its forward recomputed by its backward."""
    unit, dense_layer = _unit_and_dense_layer(model, seq_len)
    return 3 * unit, 3 * RECOMPUTED * dense_layer * prefix_layers(model), head_flops(model)


def layer_shares(model: ModelConfig, seq_len: int,
                 expert_rows: float = 1.0) -> tuple[float, float]:
    """(one stacked unit's, one dense prefix layer's) share of all the layers' FLOPs:
    how the planner splits `hardware_flops_per_token`'s layers (at the same
    `expert_rows`) among the stages (a unit of model.moe.every layers is not every
    times the average layer; a dense prefix layer holds none of the experts' rows)."""
    unit, dense_layer = _unit_and_dense_layer(model, seq_len, expert_rows)
    total = stack_layers(model) * unit + prefix_layers(model) * dense_layer
    return unit / total, dense_layer / total


def hardware_flops_per_token(model: ModelConfig, seq_len: int, recompute_forward: bool,
                             recompute_attention: bool, split_backward: bool = False,
                             expert_rows: float = 1.0) -> tuple[float, float]:
    """(the layers' training FLOPs per token with what remat recomputes, the head's):
    model FLOPs (FULL_SCORES) plus the recomputed forward (`recompute_forward`: a third
    of the layers'), or the attention's dots (`recompute_attention`: 4 L H Q T), and
    with a split backward under remat the recomputation and the input gradient (a
    third) once more (12N instead of 8N under full remat). `expert_rows`: the expert
    rows the compiled MoE layers multiply per routed copy (framework/model/moe.py's
    `executed_rows`: capacity slots, or a compiler's dense expansion)."""
    head = head_flops(model)
    base = model_flops_per_token(model, seq_len) - head
    if model.moe.enabled:  # the routed experts' matmuls as the program runs them
        base += (expert_rows - 1.0) * 6 * routed_params(model) * moe_layers(model)
    recomputed = base / 3 if recompute_forward else 0.0
    if recompute_attention:
        recomputed = float(4 * model.n_layers * model.n_heads * model.head_dim * seq_len)
    twice = recomputed + base / 3 if split_backward and (recompute_forward or
                                                         recompute_attention) else 0.0
    return base + recomputed + twice, head


def fp8_matmul_share(model: ModelConfig, seq_len: int) -> float:
    """The share of the layers' model FLOPs that `model.fp8` runs as FP8 matmuls: the
    weights' matmuls (6 x the layers' matrix weights per token), not the attention's
    score and value dots, which stay in the compute dtype (0 without FP8)."""
    if model.fp8 == "none":
        return 0.0
    spec, moe = spec_of(model), moe_layers(model)  # the rest dense (prefix.py)
    matmuls = 6.0 * (moe * spec.layer_matrix_params(model) + (model.n_layers - moe)
                     * spec.layer_matrix_params(dense_config(model)))
    return matmuls / (model_flops_per_token(model, seq_len) - head_flops(model))

