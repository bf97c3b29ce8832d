"""The model's sizes counted from its settings: parameters (all, or a token's active
ones), one layer's matmul weights, the keys each layer's queries span. The FLOP counts
(framework/model/flops.py) and the stage balance read them; the registry hands them out
as the Llama family's (framework/model/registry.py).
"""

from __future__ import annotations

from framework.config import ModelConfig
from framework.model.moe import matrix_params as moe_matrix_params
from framework.model.prefix import dense_config
from framework.model.router import moe_layers


def layer_matrix_params(cfg: ModelConfig, active: bool = True) -> int:
    """Weights of one layer's matmuls: wqkv and wo, the gated MLP's three matrices, or
    the MoE layer's (framework/model/moe.py's `matrix_params`)."""
    c = cfg
    attention = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    if not c.moe.enabled:
        return attention + 3 * c.d_model * c.d_ff
    return attention + moe_matrix_params(c, active)


def keys_per_query(cfg: ModelConfig, seq_len: int) -> list[int]:
    """Per layer, the keys a query's scores span at most: seq_len, or the window on a
    sliding-window layer (`ModelConfig.global_layer`). The FLOP count and the stage
    balance read it."""
    return [seq_len if cfg.global_layer(i) else min(cfg.sliding_window, seq_len)
            for i in range(cfg.n_layers)]


def count_params(cfg: ModelConfig, active: bool = False) -> int:
    """Every parameter (`active`: a mixture of experts' top_k experts only, the
    parameters one token uses)."""
    c = cfg
    attn = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim * c.has_qkv_bias  # qkv_bias
    attn += 2 * c.head_dim * c.has_qk_norm  # q_norm, k_norm scales
    layer = lambda c: layer_matrix_params(c, active) + attn + (4 if c.has_post_norms else 2) \
        * c.d_model
    head = c.d_model + (0 if c.tie_embeddings else c.d_model * c.vocab_size)
    moe = moe_layers(c)  # the rest dense: a prefix, a unit's first every - 1 (prefix.py)
    layers = moe * layer(c) + (c.n_layers - moe) * layer(dense_config(c))
    if c.moe.bias_update_rate and not active:  # the balancing bias: not in a matmul
        layers += moe * c.moe.experts
    return c.vocab_size * c.d_model + layers + head
