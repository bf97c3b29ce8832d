"""Autoregressive decoding with a KV cache, on one device or with tensor parallelism.

The prompt runs through the model once (prefill), writing every layer's keys and values
into a cache [layers, batch, max_len, kv_heads@tensor, head_dim]; each new token then
costs one position: its q/k/v, rotary at its absolute position (the cache length), and
attention over the cached positions (framework/model/llama.py, `Attention` with a cache).

Parallelism: the same `shard_map` over the mesh as training, manual over every axis,
with the canonical parameters sharded over `tensor` only by the same logical-axis table
(framework/parallel/rules.py: heads, kv_heads, mlp, vocab -> tensor) and replicated over
`pipe` and `data`; the cache is split by kv heads. The blocks call Megatron's
collectives through `TensorParallel` exactly as in training (two all-reduces per
layer), and the head returns each device's vocabulary slice, which the shard_map
assembles into full logits for sampling. On a (pipe, data, context, tensor) training mesh every
pipe/data replica decodes the same tokens.

`greedy_by_recompute` is the naive reference: the full forward over the whole sequence
for every new token, no cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from framework.model.prefix import DENSE, dense_config, prefix_layers, table_of
from framework.model import reference
from framework.parallel import rules as sharding
from framework.config import ModelConfig
from framework.model.registry import spec_of
from framework.parallel.mesh import TENSOR
from framework.parallel.tensor import TensorParallel

CACHE_SPEC = P(None, None, None, TENSOR, None)  # [layers, batch, max_len, kv@tensor, hd]


def sample(logits, key, temperature, top_k, top_p):
    """Next token per row of logits [batch, vocab] f32. temperature 0: argmax. Else
    softmax(logits / temperature) restricted to the top_k most likely tokens (0: all),
    then to the smallest set of those holding top_p of their probability (nucleus
    sampling, Holtzman et al. 2020; 1: all). The settings may be traced values, so one
    compiled step serves every setting."""
    vocab = logits.shape[-1]
    masked = jnp.finfo(jnp.float32).min
    scaled = logits / jnp.maximum(temperature, 1e-6)
    ranked = jnp.sort(scaled, axis=-1)[:, ::-1]  # descending
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = jnp.take(ranked, k - 1, axis=-1)[:, None]  # [batch, 1]
    ranked = jnp.where(jnp.arange(vocab) < k, ranked, masked)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
    cutoff = jnp.min(jnp.where(before < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
    cutoff = jnp.where(top_p < 1.0, jnp.maximum(cutoff, kth), kth)
    sampled = jax.random.categorical(key, jnp.where(scaled < cutoff, masked, scaled), axis=-1)
    return jnp.where(temperature == 0, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)


@dataclass(frozen=True)
class Sampling:
    """How each new token is drawn (`sample`): temperature 0 is greedy (argmax); else
    top_k (0: all) and top_p (1: all) narrow the choice, and token i's random key is
    fold_in(key(seed), i), so a seed gives the same tokens every run."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


class Decoder:
    """Compiled prefill/step functions for one model on one mesh (pipe, data, context, tensor)."""

    def __init__(self, cfg: ModelConfig, mesh: jax.sharding.Mesh):
        self.cfg, self.mesh, self.spec = cfg, mesh, spec_of(cfg)
        self.tp = TensorParallel(TENSOR, mesh.shape[TENSOR])
        self.param_specs = sharding.param_specs(self.spec.logical_axes(cfg))  # layers: whole
        self.param_shardings = sharding.named(mesh, self.param_specs)
        self.cache_sharding = NamedSharding(mesh, CACHE_SPEC)
        cache_specs = self.spec.kv_cache(CACHE_SPEC, CACHE_SPEC)
        self._forward = jax.shard_map(self._local_forward, mesh=mesh,
                                      in_specs=(self.param_specs, P(), P(), cache_specs),
                                      out_specs=(P(None, TENSOR), cache_specs))
        replicated = NamedSharding(mesh, P())  # every process can read the tokens
        self._step = jax.jit(self._sample_step, donate_argnums=(3,),
                             out_shardings=(replicated, self.spec.kv_cache(
                                 self.cache_sharding, self.cache_sharding)))

    def _local_forward(self, params, tokens, start, cache):
        """On each device: tokens [b, s] at positions start.. -> (its vocabulary slice of
        the last position's logits [b, vocab@tensor], the updated cache)."""
        c, tp, spec = self.cfg, self.tp, self.spec
        x = spec.embed(c, tp).apply({"params": table_of(params["embed"])}, tokens)
        k = prefix_layers(c)  # a MoE model's dense layers first: cache rows [:k] (prefix.py)
        if k:
            x, cache = spec.apply_layers_cached(dense_config(c), params["embed"][DENSE], x,
                                                cache, start, tp)
        x, cache = spec.apply_layers_cached(c, params["layers"], x, cache, start, tp, first=k)
        logits = spec.head(c, tp).apply({"params": params["head"]}, x[:, -1:],
                                        tied_table=params["embed"]["table"])
        return logits[:, 0], spec.kv_cache(*cache)

    def _sample_step(self, params, tokens, start, cache, seed, index, settings):
        logits, cache = self._forward(params, tokens, start, cache)
        key = jax.random.fold_in(jax.random.key(seed), index)
        return sample(logits, key, *settings), cache

    def init_cache(self, batch: int, max_len: int):
        c = self.cfg
        shape = (c.n_layers, batch, max_len, c.n_kv_heads, c.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(c.dtype)),
                        out_shardings=self.cache_sharding)
        return self.spec.kv_cache(zeros(), zeros())

    def place(self, params):
        """Canonical parameters (host or device) -> this decoder's shardings."""
        return jax.device_put(params, self.param_shardings)

    def generate(self, params, prompt, max_new_tokens: int, sampling: Sampling = Sampling(),
                 eos_ids: tuple[int, ...] = (), on_token=None) -> np.ndarray:
        """prompt [batch, prompt_len] ids -> [batch, <= max_new_tokens] new ids (fewer if
        every row reached one of `eos_ids`), drawn as `sampling` says (default: greedy).
        params: canonical, placed by `place`. `on_token(ids [batch])` sees each token as
        it is made."""
        prompt = np.asarray(prompt, np.int32)
        batch, length = prompt.shape
        settings = (np.float32(sampling.temperature), np.int32(sampling.top_k),
                    np.float32(sampling.top_p))
        cache = self.init_cache(batch, length + max_new_tokens)
        tokens, start, out = prompt, 0, []  # host values: the same on every process
        for i in range(max_new_tokens):
            new, cache = self._step(params, tokens, np.int32(start), cache,
                                    np.uint32(sampling.seed), np.int32(i), settings)
            host = np.asarray(jax.device_get(new))
            out.append(host)
            if on_token is not None:
                on_token(host)
            if eos_ids and np.all(np.isin(host, eos_ids)):
                break
            start += tokens.shape[1]
            tokens = new[:, None]
        return np.stack(out, axis=1) if out else np.zeros((batch, 0), np.int32)


def greedy_by_recompute(cfg: ModelConfig, params, prompt, max_new_tokens: int) -> np.ndarray:
    """The naive reference: greedy decoding that reruns the full single-device forward
    (framework/model/reference.py) over the whole sequence for every new token. The sequence
    lives in a fixed [batch, prompt_len + max_new_tokens] buffer (causal attention: the
    padding after position t cannot change the logits at t), so it compiles once."""
    prompt = np.asarray(prompt, np.int32)
    batch, length = prompt.shape
    buffer = np.zeros((batch, length + max_new_tokens), np.int32)
    buffer[:, :length] = prompt
    forward = jax.jit(partial(reference.forward, cfg=cfg))
    for i in range(max_new_tokens):
        logits = forward(params, jnp.asarray(buffer))[:, length + i - 1]
        buffer[:, length + i] = np.asarray(jnp.argmax(logits, axis=-1))
    return buffer[:, length:]
