"""The model's settings (`ModelConfig`), and what each model family presets.

Part of `framework.config` (import them from there); nothing here imports JAX or any
other part of the framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(unsafe_hash=True)  # hashable: the planner's caches key on it
class RopeScaling:
    """RoPE frequency scaling. rope_type none: plain RoPE (the other fields unused).
    llama3 (`rope_type: llama3` in Hugging Face configs): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are stretched `factor` times,
    those shorter than .../high_freq_factor are kept, and the band between is
    interpolated (Llama 3, Dubey et al. 2024; framework/model/llama.py)."""

    rope_type: str = "none"  # none | llama3
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(unsafe_hash=True)
class MoeConfig:
    """A mixture-of-experts feed-forward in place of the gated MLP (framework/model/moe.py).
    experts 0: every layer's feed-forward is the dense MLP. Else each token's router
    scores softmax(x W_router) over `experts` SwiGLU experts of width `expert_hidden`
    (Hugging Face: moe_intermediate_size for Qwen3-MoE, intermediate_size for Mixtral),
    and the token goes to its `top_k` best (every token to all of its top_k: dropless,
    as transformers computes), weighted by their probabilities, renormalised to sum to
    1 with `renormalize` (Qwen3-MoE's norm_topk_prob; Mixtral always). Losses added to
    the training loss (their gradients only: the reported loss is the cross-entropy):
    aux_loss_coef x the load-balancing loss (Switch Transformer, Fedus et al. 2021;
    transformers' load_balancing_loss_func) E sum_e f_e P_e, f_e the fraction of
    tokens whose top_k holds expert e, P_e the mean probability of e; z_loss_coef x
    the router z-loss (ST-MoE, Zoph et al. 2022), the mean of logsumexp(logits)^2. Both
    are statistics of one microbatch of one data replica (its tokens over `context`
    and `tensor` pooled), averaged over the step's data x microbatches of them and over
    the MoE layers (transformers pools all layers' tokens into one statistic: not
    computable stage by stage, so the per-layer mean here differs from it).

    `router` sigmoid (DeepSeek-V3, DeepSeek-AI 2024): scores sigmoid(x W_router) in
    float32, the top_k by score, their weights the selected scores (renormalised to sum
    1 with `renormalize`, DeepSeek-V3's norm_topk_prob); its load-balancing loss's P_e
    is the mean over tokens of s_e / sum_j s_j, DeepSeek-V3's sequence-wise balance
    loss's per-token normalised scores (computed here over the same group as above,
    not per sequence, and with this f_e: DeepSeek-V3's f_e carries E / top_k more).
    `bias_update_rate` gamma > 0: its auxiliary-loss-free balancing, a bias per layer and
    expert added to the scores for choosing only (e_score_correction_bias), moved by
    gamma x sign(mean load - load) after each step (framework/model/router.py; with
    either router). Either router's weights are then multiplied by
    `routed_scale` (DeepSeek's routed_scaling_factor). The z-loss is on the logits.
    `shared_experts` (DeepSeek-V2/V3's n_shared_experts; Qwen2-MoE has one): every token
    also goes through one dense gated MLP of width shared_experts x expert_hidden
    (`shared_hidden` overrides it: Qwen2-MoE's shared_expert_intermediate_size), added
    to the experts' weighted sum; with `shared_gate` its output is multiplied by
    sigmoid(x w_gate), w_gate [d_model, 1] (Qwen2-MoE's shared_expert_gate)."""

    experts: int = 0  # 0: dense feed-forward everywhere
    top_k: int = 2
    expert_hidden: Optional[int] = None  # one expert's hidden width; null: model.d_ff
    renormalize: bool = True  # the top_k weights divided by their sum
    # Which layers are MoE: layer i iff i >= first_dense and (i - first_dense + 1) % every
    # == 0 (each group of `every` layers ends with its MoE one: framework/model/prefix.py's
    # stacked unit). The first_dense dense layers (DeepSeek-V3's
    # first_k_dense_replace) run on the first stage after the embedding
    # (framework/model/prefix.py); d_ff is their width, expert_hidden the experts'.
    every: int = 1
    first_dense: int = 0
    shared_experts: int = 0  # experts every token goes through, as one MLP (0: none)
    shared_hidden: Optional[int] = None  # their MLP's width; null: shared_experts x expert_hidden
    shared_gate: bool = False  # their output times sigmoid(x w_gate) (Qwen2-MoE)
    router: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    routed_scale: float = 1.0  # the top_k weights' factor (DeepSeek's routed_scaling_factor)
    # null: dropless (every copy reaches its expert, grouped matmuls). c > 0: each expert
    # takes at most ceil(c x s x top_k / experts) copies of each sequence of s tokens,
    # first come first served; the rest are dropped (the token keeps its residual),
    # counted in moe/dropped_fraction. Static buffers: dense batched matmuls on every
    # compiler and an all-to-all of c x the copies' bytes (framework/model/moe.py).
    capacity_factor: Optional[float] = None
    aux_loss_coef: float = 0.0  # Mixtral's router_aux_loss_coef (0.02 in its config)
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0  # DeepSeek-V3's bias update speed gamma (0.001); 0: off
    # group-limited routing (DeepSeek-V3's n_group 8, topk_group 4): the experts in
    # `expert_groups` groups, each token's top_k chosen among its `top_groups` best groups
    expert_groups: int = 1
    top_groups: int = 1

    @property
    def enabled(self) -> bool:
        return self.experts > 0


# What each model family presets (model.family): the settings that set it apart from
# Llama, per the families' modeling code in transformers (Qwen2: biases on q_proj,
# k_proj, v_proj, not o_proj; Qwen3: an RMSNorm over each q and k head before RoPE,
# no biases; Mistral: Llama's layer; Gemma 2, modeling_gemma2.py: RMSNorm scaled by
# (1 + w), a norm after each sublayer as well as before, GeGLU with the tanh GELU
# (`gelu_pytorch_tanh`), embeddings times sqrt(hidden_size)). The model reads the
# settings, never the name; a family's Hugging Face config.json is read by
# framework/io/hf/family.py.
# Unset everywhere: PRESET_DEFAULTS, Llama's layer.
PRESET_DEFAULTS: dict[str, Any] = {"qkv_bias": False, "qk_norm": False, "norm_plus_one": False,
                                   "post_norms": False, "activation": "silu",
                                   "embed_scale": False}


def cast_at_use(dims_a_use: int) -> bool:
    """Whether the layers cast a parameter with this many dimensions a use to the
    compute dtype (`ModelConfig.dtype`) before every use: the matrices (two or more:
    the weights, q/k/v biases, the router); the vectors (norm scales, the router's
    bias) are used in float32. FSDP's gathers (framework/parallel/data.py) and the tick
    executor's once-a-step copy cast what it names (`parallel.data.narrowed`);
    tests/parity/test_step_weights.py shows the numbers unchanged."""
    return dims_a_use >= 2


@dataclass(frozen=True)
class HfFamily:
    """How a family's Hugging Face config.json reads (framework/io/hf/family.py)."""

    architecture: str  # config.json's `architectures`
    fixed: dict = field(default_factory=dict)  # keys that must hold these values (absent: ok)
    window_switch: str | None = None  # the key that turns a sliding window on (qwen)
    has_window: bool = False  # `sliding_window` is read at all
    window_layers: str = "switch"  # which layers slide: switch (qwen: refused), all
    # (mistral) or layer_types (gemma2: a pattern)
    activation_key: str = "hidden_act"  # the config.json key of the MLP's activation
    gemma_scores: bool = False  # query_pre_attn_scalar and the two soft-caps are read
    # qwen's switched-on window: on the layers below max_window_layers (every other one:
    # qwen2_moe), else on those from it on (qwen2, qwen3, qwen3_moe)
    window_below: bool = False


@dataclass(frozen=True)
class Family:
    """One model family (`model.family`), its one record: the settings it presets, the
    model architecture that runs it (a key of framework/model/registry.py's
    ARCHITECTURES) and its Hugging Face config.json (its `model_type` is the key)."""

    presets: dict
    hf: HfFamily
    architecture: str = "decoder"


# A new family of an existing architecture: one entry here (and, if its weights are
# laid out otherwise, a module of framework/io/hf/).
FAMILIES: dict[str, Family] = {
    "llama": Family({}, HfFamily("LlamaForCausalLM",
                                 {"attention_bias": False, "mlp_bias": False})),
    "qwen2": Family({"qkv_bias": True},
                    HfFamily("Qwen2ForCausalLM", {}, "use_sliding_window", True)),
    "qwen3": Family({"qk_norm": True}, HfFamily("Qwen3ForCausalLM", {"attention_bias": False},
                                                "use_sliding_window", True)),
    "mistral": Family({}, HfFamily("MistralForCausalLM", {}, None, True, "all")),
    # Mixtures of experts (model.moe): Qwen3's attention, Mistral's (Llama's layer) or Qwen2's
    "qwen3_moe": Family({"qk_norm": True},
                        HfFamily("Qwen3MoeForCausalLM", {"attention_bias": False},
                                 "use_sliding_window", True)),
    "mixtral": Family({}, HfFamily("MixtralForCausalLM", {}, None, True, "all")),
    # Qwen2's attention (q/k/v biases; transformers 5's config.json says qkv_bias) and a
    # sigmoid-gated shared expert beside the routed ones (framework/io/hf/moe.py)
    "qwen2_moe": Family({"qkv_bias": True},
                        HfFamily("Qwen2MoeForCausalLM", {"qkv_bias": True},
                                 "use_sliding_window", True, window_below=True)),
    "gemma2": Family({"norm_plus_one": True, "post_norms": True, "activation": "gelu_tanh",
                      "embed_scale": True},
                     HfFamily("Gemma2ForCausalLM", {"attention_bias": False}, None, True,
                              "layer_types", "hidden_activation", True)),
}
FAMILY_PRESETS: dict[str, dict[str, Any]] = {k: f.presets for k, f in FAMILIES.items()}


@dataclass(unsafe_hash=True)
class ModelConfig:
    """A Llama-style decoder. `dtype` is the compute dtype (the stored parameters':
    optim.param_dtype, float32 by default).
    `family` presets qkv_bias and qk_norm where they are left null (FAMILY_PRESETS):
    read them as `has_qkv_bias`, `has_qk_norm`. (Resolved when read, not stored: a
    preset stored at construction would stay behind when Hydra or `replace` changes
    the family.)"""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 352
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "float32"
    attention: str = "auto"  # auto | dense | blockwise | cudnn (framework/model/attention.py)
    attention_block_q: int = 512  # blockwise: queries per block
    attention_block_kv: int = 512  # blockwise: keys per block
    # The loss over the vocabulary this many tokens at a time, the logits never alive
    # for more (framework/model/loss.py); 0: over the whole microbatch's logits
    loss_chunk: int = 0
    # The family (a key of FAMILIES): the Hugging Face architecture export
    # writes, and the preset of the two settings below where they are null.
    family: str = "llama"
    qkv_bias: Optional[bool] = None  # biases on the q, k, v projections (Qwen2)
    qk_norm: Optional[bool] = None  # RMSNorm over each q and k head before RoPE (Qwen3)
    # Width of one attention head when not d_model / n_heads (Qwen3-0.6B: 1024 / 16
    # heads, 128 each); null: d_model / n_heads. Read it as `head_dim`.
    explicit_head_dim: Optional[int] = None
    # Gemma 2's layer (presets where null; read them as the properties below):
    norm_plus_one: Optional[bool] = None  # RMSNorm scaled by (1 + w), w initialised to 0
    post_norms: Optional[bool] = None  # an RMSNorm on each sublayer's output too (4 a layer)
    activation: Optional[str] = None  # the gated MLP's: silu (SwiGLU) | gelu_tanh (GeGLU)
    embed_scale: Optional[bool] = None  # embeddings times sqrt(d_model)
    # Attention (framework/model/attention.py): a key is visible iff fewer than
    # sliding_window positions before the query (null: no window), on every layer
    # (sliding_window_pattern 0, Mistral) or on all but every k-th (k: layer i is
    # global iff (i + 1) % k == 0; Gemma 2: 2, transformers' layer_types). Scores
    # scaled by query_pre_attn_scalar^-1/2 (null: head_dim^-1/2) and soft-capped
    # c tanh(s / c) with c = attn_softcap (null: not); the logits with final_softcap.
    sliding_window: Optional[int] = None
    sliding_window_pattern: int = 0
    query_pre_attn_scalar: Optional[float] = None
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    # FP8 matmuls in the layers (framework/model/fp8.py): none, tensorwise (E4M3
    # forward, E5M2 gradients, each tensor scaled by its absolute maximum in the step),
    # or delayed (activations and gradients scaled by the largest absolute maximum of
    # the last fp8_history steps, powers of two: framework/model/fp8_delayed.py)
    fp8: str = "none"
    # A mixture of experts in place of the gated MLP (MoeConfig; experts 0: none)
    moe: MoeConfig = field(default_factory=MoeConfig)
    # With FP8 and FSDP gathering per use: the layers' matrices gathered as E4M3 with
    # their scales (half bfloat16's bytes), else in the compute dtype
    fp8_gather: bool = True
    # With model.fp8=delayed and parallel.expert > 1: a MoE's slots sent to their experts'
    # devices as E4M3 at their matmul's delayed scale (half the dispatch's bytes, the
    # same numbers: framework/model/moe_slots.py), else in the compute dtype
    fp8_dispatch: bool = True
    # With FP8: the `fp8/` statistics of the layers' matmul inputs and output gradients
    # (framework/engine/fp8_probe.py), a pass over each per microbatch; false: none
    fp8_stats: bool = True
    # With model.fp8=delayed: how many steps' absolute maxima a scale is taken from
    fp8_history: int = 16

    def family_setting(self, name: str):
        """A preset setting as given, else the family's preset, else PRESET_DEFAULTS."""
        given = getattr(self, name)
        if given is not None:
            return given
        return FAMILY_PRESETS.get(self.family, {}).get(name, PRESET_DEFAULTS[name])

    @property
    def has_qkv_bias(self) -> bool:
        return bool(self.family_setting("qkv_bias"))

    @property
    def has_qk_norm(self) -> bool:
        return bool(self.family_setting("qk_norm"))

    @property
    def has_norm_plus_one(self) -> bool:
        return bool(self.family_setting("norm_plus_one"))

    @property
    def has_post_norms(self) -> bool:
        return bool(self.family_setting("post_norms"))

    @property
    def mlp_activation(self) -> str:
        return self.family_setting("activation")

    @property
    def has_embed_scale(self) -> bool:
        return bool(self.family_setting("embed_scale"))

    @property
    def moe_shape(self) -> tuple:
        """What of `moe` shapes the parameters: experts, their width, shared experts,
        the dense layers first, MoE every k-th layer, the balancing bias (on or off)."""
        m = self.moe
        return (m.experts, m.expert_hidden, m.shared_experts, m.shared_hidden, m.shared_gate,
                m.first_dense, m.every, m.bias_update_rate > 0) if m.enabled else ()

    def global_layer(self, index):
        """Whether layer `index` (an int, or an int array: then elementwise) attends to
        every earlier position: all do without a window; with one, those with
        (index + 1) % sliding_window_pattern == 0 (0: none, Mistral; Gemma 2's
        layer_types, transformers' configuration_gemma2.py: layers 1, 3, ...). The
        model, the FLOP count and the Hugging Face export read this one rule."""
        if self.sliding_window is None:
            return True
        k = self.sliding_window_pattern
        return (index + 1) % k == 0 if k else False

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.n_heads
