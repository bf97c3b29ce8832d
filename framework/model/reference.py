"""The naive single-device reference: the whole model on one device, no microbatches,
no collectives. Every parallel path is tested against this (loss and gradients), and
`tools/bench.py` times the framework against `reference_train_step`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from framework.config import ModelConfig
from framework.model.documents import DocumentMask, documents_of
from framework.model.llama import Block, Embed, Head, cross_entropy_sum
from framework.model.prefix import DENSE, dense_config, prefix_layers, table_of
from framework.model.router import BIAS, LOAD, update_bias
from framework.parallel.tensor import TensorParallel


def forward(params, inputs, cfg: ModelConfig, documents: DocumentMask | None = None,
            groups: int = 1, loads: bool = False):
    """inputs: [batch, seq] int32 -> logits [batch, seq, vocab] float32 (`documents`:
    attention within the documents of each row, framework/model/documents.py). `groups`:
    how many such groups a step's batch has (a mixture of experts' auxiliary losses are
    averaged over them: `loss_fn`). `loads` (a mixture of experts): (logits, the token
    copies each layer routed to each expert [L, E])."""
    x = Embed(cfg).apply({"params": table_of(params["embed"])}, inputs)
    docs = documents_of(inputs, documents)
    tp = TensorParallel(groups=groups)  # no axis: every collective the identity
    if prefix_layers(cfg):  # a MoE model's dense layers first (prefix.py)
        x = _layers(dense_config(cfg), params["embed"][DENSE], x, docs, tp, 0, False)[0]
    x, routed = _layers(cfg, params["layers"], x, docs, tp, prefix_layers(cfg), loads)
    logits = Head(cfg).apply({"params": params["head"]}, x, tied_table=params["embed"]["table"])
    return (logits, routed) if loads else logits


def _layers(cfg: ModelConfig, stacked, x, docs, tp, first: int, loads: bool):
    """x through the layers stacked [n, ...] (global layers first..first+n-1): (y, with
    `loads` each layer's token copies per expert [n, E], else None)."""
    def layer(x, layer_params, window=None):
        y, seen = Block(cfg, tp).apply({"params": layer_params}, x, docs=docs, window=window,
                                       mutable=["intermediates"])
        return y, (seen["intermediates"]["moe"][LOAD][0] if loads else None)

    n = jax.tree.leaves(stacked)[0].shape[0]
    if cfg.sliding_window_pattern and cfg.sliding_window:  # layer by layer, in Python
        per_layer = []
        for i in range(n):
            x, load = layer(x, jax.tree.map(lambda a: a[i], stacked), window_of(cfg, first + i))
            per_layer.append(load)
        return x, (jnp.stack(per_layer) if loads else None)
    return jax.lax.scan(lambda x, p: layer(x, p, cfg.sliding_window), x, stacked)


def balanced(used, new, tokens, cfg: ModelConfig):
    """`new` params with each MoE layer's balancing bias moved from its value in `used`
    (the params a step ran with) by the loads the batch `tokens` [batch, seq + 1] put on
    its experts under them (framework/model/router.py; the train step recounts the same
    from its statistics)."""
    _, loads = forward(used, tokens[:, :-1], cfg, loads=True)  # [L, E]
    bias = update_bias(used["layers"]["moe"][BIAS], loads, cfg.moe.bias_update_rate)
    moe = dict(new["layers"]["moe"], **{BIAS: bias})
    return dict(new, layers=dict(new["layers"], moe=moe))


def window_of(cfg: ModelConfig, i: int):
    """Layer i's sliding window (None: full attention), as Gemma 2's config says it
    (transformers' configuration_gemma2.py: layer i slides iff (i + 1) % 2)."""
    pattern = cfg.sliding_window_pattern
    return cfg.sliding_window if not pattern or (i + 1) % pattern else None


def loss_fn(params, tokens, cfg: ModelConfig, z_loss: float = 0.0,
            documents: DocumentMask | None = None, groups: int = 1):
    """Mean next-token cross-entropy (+ the z-loss term). tokens: [batch, seq + 1].
    `groups`: the rows as this many consecutive groups, each run on its own: a mixture of
    experts' auxiliary losses are statistics of a group (a layout's data replicas x
    microbatches; framework/config/model.py's MoeConfig), whose gradients reach the
    weights (not this value: the cross-entropy, the same for any grouping)."""
    def group_loss(rows):  # [batch / groups, seq + 1]
        logits = forward(params, rows[:, :-1], cfg, documents, groups)
        return cross_entropy_sum(logits, rows[:, 1:], z_loss=z_loss)

    if groups == 1:
        return group_loss(tokens) / tokens[:, 1:].size
    per_group = jax.lax.map(group_loss, tokens.reshape((groups, -1) + tokens.shape[1:]))
    return jnp.sum(per_group) / tokens[:, 1:].size


def loss_and_grads(params, tokens, cfg: ModelConfig, z_loss: float = 0.0,
                   documents: DocumentMask | None = None, groups: int = 1):
    return jax.value_and_grad(loss_fn)(params, tokens, cfg, z_loss, documents, groups)


def reference_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation):
    """A plain jitted AdamW step: (params, opt_state, tokens) -> (params, opt_state, loss)."""

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = loss_and_grads(params, tokens, cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        if cfg.moe.enabled and cfg.moe.bias_update_rate:
            new = balanced(params, new, tokens, cfg)
        return new, opt_state, loss

    return step


def tokens_for_step(seed: int, step: int, batch: int, seq_len: int, vocab: int):
    """A seeded synthetic token stream: [batch, seq_len + 1] int32, a pure function of
    (seed, step), so every layout sees the same data."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.randint(key, (batch, seq_len + 1), 0, vocab, dtype=jnp.int32)
