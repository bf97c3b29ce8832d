"""A Llama decoder in Flax (linen), written in *logical* axes.

Every parameter carries logical axis names (`embed`, `heads`, `kv_heads`, `mlp`,
`vocab`, ...); the table that maps them to the (pipe, data, context, tensor) mesh lives in
`framework/parallel/rules.py`. The model never sees a mesh: weights are declared with their
global shapes, and a `TensorParallel` object (`framework/parallel/tensor.py`) derives
from those rules each device's shard of them and the Megatron operators each block
needs around its matmuls (named by the logical axis the block splits); the default one
splits nothing, which is the single-device model. Attention kernels are in
`framework/model/attention.py` (`model.attention`).

The model is split into three pieces so a pipeline can place them: `Embed` (token
ids -> hidden states), `Block` (one decoder layer; the pipeline stacks and scans
these) and `Head` (final norm + LM head). `init_params` returns the *canonical*
parameter tree: {'embed', 'layers' (stacked along a leading `layers` axis), 'head'}.

Decoding (framework/engine/decode.py) uses the same modules and weights: `Attention` and
`Block` take an optional KV cache and the position of their first row
(`apply_layers_cached`), and `rotary` takes explicit positions. A stack of layers under
`scan`, with its remat policy, is in framework/model/stack.py.

The other families are settings of the same layers (`model.family` presets them,
framework/config/model.py): q/k/v biases (Qwen2), q/k norm and a head width of its own
(Qwen3), Gemma 2's (1 + w) norms after each sublayer too, GeGLU, scaled embeddings,
soft-capped scores and logits and sliding-window layers (framework/model/layers.py:
a layer's window comes from its global index, which a stage's layer scan is handed
as `first`); the model reads the settings, never the family's name.

Llama: Touvron et al. 2023. RMSNorm: Zhang & Sennrich 2019. RoPE: Su et al. 2021.
GQA: Ainslie et al. 2023. SwiGLU: Shazeer 2020. Qwen2: Yang et al. 2024. Qwen3: Yang
et al. 2025 (its q/k norm: transformers' modeling_qwen3.py).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import flax.linen as nn

from framework.model import fp8
from framework.model.attention import attend, score_form
from framework.model.documents import Documents
from framework.model.layers import MLP, NO_TP, param, norm, softcap
from framework.model.loss import (chunked_cross_entropy_sum,  # noqa: F401 (re-export)
                                  cross_entropy_sum)
from framework.model.moe import MoE, check_moe
from framework.model.sizes import (count_params, keys_per_query,  # noqa: F401 (re-export)
                                   layer_matrix_params)
from framework.model.prefix import (DENSE, UNIT_DENSE, dense_config, prefix_layers,
                                    stack_layers, unit_layers)
from framework.model.fp8_delayed import is_history
from framework.model.router import UNTRAINED
from framework.model.ring_attention import ring_attention
from framework.model.rope import check_rope_scaling, rotary
from framework.model.weight_ops import (GIVEN, PRODUCTS, SAVED, TAPS,  # noqa: F401 (re-export)
                                        bias_op, gathered_weight_op, scattered_weight_op)
from framework.config import ModelConfig, not_one_of
from framework.parallel.tensor import TensorParallel


def replay_weight_ops(cfg: ModelConfig, tp: TensorParallel, params, given):
    """The outputs of one Block's weight ops applied to `given` inputs (as SAVED recorded
    them), {module: {weight: y}}: the zero-bubble split backward's W half pulls the
    output gradients back through these (framework/engine/split.py). The rest of the
    block is dead code, which XLA drops."""
    x = jnp.zeros_like(given["attn_norm"]["scale"])  # the block's input shape: dead code
    return Block(cfg, tp).apply({**fp8.variables(params), GIVEN: given}, x,
                                mutable=[PRODUCTS])[1][PRODUCTS]


def _traceable(cfg: ModelConfig) -> ModelConfig:
    """`cfg` for tracing what does not depend on the attention kernel (the weights and
    which of them the weight ops read): with the reference kernel where cuDNN's is set
    (cuDNN's cannot even be traced without the cuDNN library)."""
    return dataclasses.replace(cfg, attention="dense") if cfg.attention == "cudnn" else cfg


def weights_outside_weight_op(cfg: ModelConfig) -> list[str]:
    """Block parameters that no `weight_op` reads ('module/name'): the split backward's
    W half replays the weight ops only, so their gradient would silently be zero under
    a zero-bubble schedule; the engine refuses them when it is built. Traced only."""
    cfg = _traceable(cfg)
    x = jax.ShapeDtypeStruct((1, 16, cfg.d_model), jnp.dtype(cfg.dtype))
    variables = jax.eval_shape(lambda x: Block(cfg).init(jax.random.key(0), x), x)
    path = lambda keys: "/".join(str(k.key) for k in keys)
    leaves = lambda tree: jax.tree_util.tree_leaves_with_path(nn.meta.unbox(tree))
    tapped = {path(keys) for keys, _ in leaves(variables.get(TAPS, {}))}
    untrained = lambda keys: str(keys[-1].key) in UNTRAINED or is_history(keys)  # by design
    return [path(keys) for keys, _ in leaves(variables["params"])
            if path(keys) not in tapped and not untrained(keys)]


class KVCache(NamedTuple):
    """Keys and values of the positions decoded so far, for one layer (stacked over
    layers by `apply_layers_cached`): [batch, max_len, kv_heads@tensor, head_dim] each.
    Entries at or after the current length are stale and masked out."""

    k: jax.Array
    v: jax.Array


class Attention(nn.Module):
    """Grouped-query causal self-attention.

    q, k and v come from one fused weight laid out per kv group, [embed, kv_heads,
    q_per_kv + 2, head_dim]: group g holds its q_per_kv query heads, then its key and
    its value head. Sharding `kv_heads` over `tensor` gives every device whole groups
    (column-parallel), and the fused matmul needs one reduction in the backward instead
    of three. The output projection is row-parallel: one reduction in the forward. The
    kernel (dense, blockwise, cudnn) is `model.attention`, see `framework/model/attention.py`.
    The families' settings: q/k/v biases laid out like wqkv's output (`model.qkv_bias`,
    Qwen2), an RMSNorm over each q and k head before RoPE (`model.qk_norm`, Qwen3), and
    heads of `model.head_dim` (`model.explicit_head_dim`, else d_model / n_heads)."""

    cfg: ModelConfig
    tp: TensorParallel = NO_TP

    @nn.compact
    def __call__(self, x, cache: KVCache | None = None, start=0, docs: Documents | None = None,
                 window=None):
        """x: [batch, seq (/tensor with SP), embed] -> the same shape. `window`: this
        layer's sliding window (int or traced int32), None: none.

        Training (cache None): causal attention among the rows of x, positions 0..seq-1
        (context parallelism: this device's chunks of them, over the whole sequence);
        with `docs`, only within each row's documents (framework/model/documents.py).
        Decoding: x holds the rows at positions start..start+seq-1; their keys and values
        are written into `cache` at those positions and the rows attend to every cached
        position up to their own. Returns (out, updated cache)."""
        c, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        d, hd, r = c.d_model, c.head_dim, c.n_heads // c.n_kv_heads  # r: q heads per kv head
        wqkv = param(self, "wqkv", (d, c.n_kv_heads, r + 2, hd),
                      ("embed", "kv_heads", "qkv", "head_dim"))
        wo = param(self, "wo", (c.n_heads, hd, d), ("heads", "head_dim", "embed"))
        # x [b, s (/tensor with SP), embed] -> qkv [b, s, kv@tensor, r+2, hd]
        qkv = gathered_weight_op(self, "wqkv", "bsd,dgjk->bsgjk", x.astype(dt),
                                 wqkv.astype(dt), "kv_heads", whole_sequence=True)
        if c.has_qkv_bias:  # Qwen2's q/k/v_proj biases, laid out like wqkv's output
            qkv = bias_op(self, "qkv_bias", qkv, param(  # [kv@tensor, r+2, hd]
                self, "qkv_bias", (c.n_kv_heads, r + 2, hd), ("kv_heads", "qkv", "head_dim"),
                nn.initializers.zeros))
        q, k, v = qkv[:, :, :, :r], qkv[:, :, :, r], qkv[:, :, :, r + 1]
        if c.has_qk_norm:  # Qwen3: RMSNorm over each q and k head's dims, before RoPE
            q, k = (norm(c, f"{n}_norm")(y) for n, y in (("q", q), ("k", k)))
        # [s]: global positions (this device's chunks of the sequence under context
        # parallelism, framework/parallel/context.py)
        positions = start + (jnp.arange(qkv.shape[1]) if cache is not None
                             else self.tp.context.positions(qkv.shape[1]))
        if docs is not None and docs.position is not None:  # [b, s]: within documents
            positions = docs.position
        q = rotary(q, c.rope_theta, positions, c.rope_scaling)  # [b, s, kv, r, hd]
        k = rotary(k, c.rope_theta, positions, c.rope_scaling)  # [b, s, kv, hd]
        if cache is not None:  # keys/values: [b, max_len, kv@tensor, hd]; the rows after
            # the cached length are stale and causally masked (later positions)
            cache = KVCache(*(jax.lax.dynamic_update_slice(whole, new.astype(whole.dtype),
                                                           (0, start, 0, 0))
                              for whole, new in ((cache.k, k), (cache.v, v))))
            k, v = cache.k.astype(dt), cache.v.astype(dt)
        segment = None if docs is None else docs.segment  # [b, seq] whole sequence
        if cache is None and self.tp.context.size > 1:  # the sequence split over `context`
            out = ring_attention(q, k, v, c, self.tp.context, segment, window, score_form(c))
        else:  # [b, s, kv@tensor, r, hd]
            out = attend(q, k, v, c, q_offset=start, window=window,
                         segments=None if segment is None else (segment, segment))
        out = out.reshape(out.shape[:2] + (-1, hd))  # [b, s, heads@tensor, hd]
        out = scattered_weight_op(self, "wo", "bshk,hkd->bsd", out, wo.astype(dt), "heads",
                                  whole_sequence=True)  # [b, s (/tensor with SP), embed]
        return out if cache is None else (out, cache)


def decoder_layer(module: nn.Module, c: ModelConfig, x, cache, start, docs, window):
    """One pre-norm decoder layer built in `module`'s scope (its submodules attn, the
    norms, mlp or moe): h = x + attn(norm(x)), out = h + ffn(norm(h)); with
    `model.post_norms` (Gemma 2) each sublayer's output is normed too:
    h = x + norm(attn(norm(x))). Returns out, or (out, cache) with a cache."""
    post = (lambda name: norm(c, name)) if c.has_post_norms else (lambda name: lambda y: y)
    attn = Attention(c, module.tp, name="attn")
    normed = norm(c, "attn_norm")(x)
    if cache is None:
        h = x + post("attn_post_norm")(attn(normed, docs=docs, window=window))
    else:
        attended, cache = attn(normed, cache, start, window=window)
        h = x + post("attn_post_norm")(attended)
    ffn = MoE(c, module.tp, name="moe") if c.moe.enabled else MLP(c, module.tp, name="mlp")
    out = h + post("mlp_post_norm")(ffn(norm(c, "mlp_norm")(h)))
    return out if cache is None else (out, cache)


class DenseLayer(nn.Module):
    """A dense decoder layer inside a unit of `model.moe.every` layers (prefix.py)."""

    cfg: ModelConfig
    tp: TensorParallel = NO_TP

    @nn.compact
    def __call__(self, x, cache=None, start=0, docs=None, window=None):
        return decoder_layer(self, self.cfg, x, cache, start, docs, window)


class Block(nn.Module):
    """What the pipeline stacks and scans: one decoder layer (`decoder_layer`, its params
    at the top), or with `model.moe.every` k > 1 a unit of k layers: k - 1 dense ones
    (submodules dense_0.., the gated MLP model.d_ff wide), then the MoE one
    (framework/model/prefix.py)."""

    cfg: ModelConfig
    tp: TensorParallel = NO_TP

    @nn.compact
    def __call__(self, x, cache: KVCache | None = None, start=0, docs: Documents | None = None,
                 window=None):
        """x: [batch, seq (/tensor with SP), embed]; with a cache (decoding, see
        Attention; a unit's: [k, ...] leaves, one per layer) returns (out, updated
        cache); `docs`: training's document masks; `window`: this layer's sliding window
        (layers.layer_windows), None: none."""
        c, k = self.cfg, unit_layers(self.cfg)
        if k == 1:
            return decoder_layer(self, c, x, cache, start, docs, window)
        caches = []
        for j in range(k):
            one = None if cache is None else KVCache(*(a[j] for a in cache))
            layer = (lambda *a: decoder_layer(self, c, *a)) if j == k - 1 else \
                DenseLayer(dense_config(c, in_unit=True), self.tp, name=UNIT_DENSE.format(j))
            x = layer(x, one, start, docs, window)
            if cache is not None:
                x, one = x
                caches.append(one)
        return x if cache is None else (x, KVCache(*(jnp.stack(a) for a in zip(*caches))))


def lookup_rows(table, tokens, tp: TensorParallel = NO_TP):
    """The rows of this device's slice of the table ([vocab@tensor, embed]) for the ids
    in it, zeros for the others: [batch, seq, embed] in the table's dtype."""
    local = tokens - tp.vocab_offset(table.shape[0])
    mine = (local >= 0) & (local < table.shape[0])
    return jnp.take(table, jnp.where(mine, local, 0), axis=0) * mine[..., None]


class Embed(nn.Module):
    """Token embedding, vocabulary-parallel: each device looks up the ids that fall in
    its slice of the table, zeros elsewhere, and `exit` sums the slices."""

    cfg: ModelConfig
    tp: TensorParallel = NO_TP
    rows = staticmethod(lookup_rows)  # (table, tokens, tp): the lookup alone

    @nn.compact
    def __call__(self, tokens, tap=None):  # tokens: [batch, seq] int32 -> [batch, seq(/tp),
        # embed]; tap: zeros added to the looked-up rows, whose gradient is theirs
        c = self.cfg
        table = param(self, "table", (c.vocab_size, c.d_model), ("vocab", "embed"))
        x = lookup_rows(table, tokens, self.tp)
        x = (x if tap is None else x + tap).astype(jnp.dtype(c.dtype))
        if c.has_embed_scale:  # Gemma 2: x sqrt(hidden_size), the factor rounded to the
            # compute dtype first, as transformers' Gemma2Model does (bfloat16: 59.75 for
            # sqrt(3584) = 59.87)
            x = x * jnp.asarray(c.d_model ** 0.5, x.dtype)
        return self.tp.exit(x, "vocab", whole_sequence=True)


class Head(nn.Module):
    """Final RMSNorm + LM head (vocabulary-parallel). With tied embeddings the caller
    passes the embedding table as `tied_table`. Returns this device's vocabulary slice
    of the logits, [batch, seq, vocab@tensor] float32, soft-capped by
    `model.final_softcap` where set (Gemma 2). `features`: what the logits are made of,
    for a loss that makes them a chunk at a time (framework/model/loss.py)."""

    cfg: ModelConfig
    tp: TensorParallel = NO_TP

    @nn.compact
    def features(self, x, tied_table=None):
        """x: [batch, seq (/tensor with SP), embed] -> (normed x [batch, seq, embed],
        w [embed, vocab@tensor]), both in the compute dtype."""
        c, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        x = self.tp.enter(norm(c, "norm")(x), "vocab").astype(dt)
        if c.tie_embeddings:
            w = tied_table.T  # [embed, vocab@tensor]
        else:
            w = param(self, "w", (c.d_model, c.vocab_size), ("embed", "vocab"))
        return x, w.astype(dt)

    def __call__(self, x, tied_table=None):
        x, w = self.features(x, tied_table)
        return softcap((x @ w).astype(jnp.float32), self.cfg.final_softcap)


def head_loss(cfg: ModelConfig, tp: TensorParallel, head, table, y, targets,
              z_loss: float = 0.0):
    """The head's token cross-entropy sum (+ z-loss) on y [b, s (/tensor with SP), embed]
    against targets [b, s] int32 (`head`: its parameters, `table`: the embedding's, read
    when tied): over the whole batch's logits (the reference) where `model.loss_chunk`
    is 0 or covers the tokens, else `model.loss_chunk` tokens at a time."""
    module, variables = Head(cfg, tp), {"params": head}
    if not cfg.loss_chunk or cfg.loss_chunk >= targets.size:
        logits = module.apply(variables, y, tied_table=table)
        return cross_entropy_sum(logits, targets, tp, z_loss)
    x, w = module.apply(variables, y, tied_table=table, method=Head.features)
    return chunked_cross_entropy_sum(x, w, targets, tp, z_loss, cfg.final_softcap,
                                     cfg.loss_chunk)


# ---------------------------------------------------------------------------------
# Parameters in canonical layout.


def _is_axes(a):
    return isinstance(a, tuple)


def _unbox(boxed):
    """Splits Flax's boxed params into (arrays, logical axis tuples)."""
    axes = nn.get_partition_spec(boxed)  # PartitionSpec of logical names per leaf
    axes = jax.tree.map(tuple, axes, is_leaf=_is_axes)
    return nn.meta.unbox(boxed), axes


def init_params_and_axes(cfg: ModelConfig, key):
    """(params, logical_axes) in canonical layout; axes are tuples of names. The weights
    do not depend on the attention kernel: the modules are initialised with the
    reference one (cuDNN's cannot even be traced without the cuDNN library)."""
    cfg = _traceable(cfg)
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    tokens = jnp.zeros((1, 2), jnp.int32)
    x = jnp.zeros((1, 2, cfg.d_model), jnp.float32)
    embed, embed_axes = _unbox(Embed(cfg).init(k_embed, tokens)["params"])
    stacked = lambda c, k, n: _stacked(lambda k: Block(c).init(k, x)["params"], k, n)
    layers, layer_axes = stacked(cfg, k_layers, stack_layers(cfg))
    if prefix_layers(cfg):  # the dense layers before the MoE ones (prefix.py)
        embed[DENSE], embed_axes[DENSE] = stacked(dense_config(cfg), jax.random.fold_in(
            k_layers, 1), prefix_layers(cfg))
    head, head_axes = _unbox(Head(cfg).init(k_head, x, tied_table=embed["table"])["params"])
    params = {"embed": embed, "layers": layers, "head": head}
    axes = {"embed": embed_axes, "layers": layer_axes, "head": head_axes}
    return params, axes


def _stacked(init_layer, key, n: int):
    """(n layers' params stacked on axis 0, their logical axes ('layers', ...))."""
    params = jax.vmap(lambda k: nn.meta.unbox(init_layer(k)))(jax.random.split(key, n))
    _, axes = _unbox(jax.eval_shape(init_layer, key))
    return params, jax.tree.map(lambda a: ("layers",) + a, axes, is_leaf=_is_axes)


def init_params(cfg: ModelConfig, key):
    """Canonical parameters {'embed', 'layers', 'head'}; layers stacked on axis 0."""
    return init_params_and_axes(cfg, key)[0]


@lru_cache(maxsize=None)
def param_logical_axes(cfg: ModelConfig):
    """Logical axis names of every canonical parameter, without allocating them (traced
    once per model; do not modify the returned tree)."""
    found = {}

    def shapes_only():
        params, found["axes"] = init_params_and_axes(cfg, jax.random.key(0))
        return params

    jax.eval_shape(shapes_only)
    return found["axes"]


def check_model(model: ModelConfig) -> list[str]:
    """Problems of the model's own shape (whatever the layout)."""
    errs = [e for e in [not_one_of("model.family", model.family)] if e]
    if model.activation is not None and not_one_of("model.activation", model.activation):
        errs.append(not_one_of("model.activation", model.activation))
    if model.sliding_window_pattern and model.sliding_window is None:
        errs.append(f"model.sliding_window_pattern={model.sliding_window_pattern} needs "
                    f"model.sliding_window (the local layers' window)")
    if model.sliding_window_pattern == 1:
        errs.append("model.sliding_window_pattern=1 makes every layer global: use 0 (every "
                    "layer local) or >= 2, or drop model.sliding_window")
    if model.d_model % model.n_heads and not model.explicit_head_dim:
        errs.append(f"model.d_model={model.d_model} is not divisible by model.n_heads="
                    f"{model.n_heads} (or set model.explicit_head_dim)")
    if model.n_heads % model.n_kv_heads:
        errs.append(f"model.n_heads={model.n_heads} is not divisible by model.n_kv_heads="
                    f"{model.n_kv_heads}: grouped-query attention needs whole groups")
    if model.head_dim % 2:
        errs.append(f"the head width {model.head_dim} (model.explicit_head_dim, else "
                    f"d_model/n_heads) must be even for rotary embeddings")
    return errs + check_rope_scaling(model.rope_scaling) + check_moe(model)
