"""Hugging Face folders of the Llama layout in and out (Llama, Qwen2, Qwen3, Mistral, Gemma 2:
their config.json in framework/io/hf/family.py): the weights <-> the canonical
parameter tree (framework/model/llama.py).

Name and layout map (transformers' LlamaForCausalLM and its families' classes, which
name their tensors alike; nn.Linear weights are [out, in]):

    model.embed_tokens.weight [vocab, d]          -> embed/table [vocab, d]
    model.layers.N.self_attn.q_proj.weight [h*hd, d] \\
                           k_proj.weight [kv*hd, d]   > layers/attn/wqkv[N] [d, kv, r+2, hd]:
                           v_proj.weight [kv*hd, d] /   group g = q heads g*r..g*r+r-1, k_g, v_g
    model.layers.N.self_attn.q/k/v_proj.bias         -> layers/attn/qkv_bias[N] [kv, r+2, hd]
        [h*hd], [kv*hd], [kv*hd] (model.qkv_bias)       grouped as wqkv's output
    model.layers.N.self_attn.q_norm/k_norm.weight    -> layers/attn/q_norm, k_norm/scale[N]
        [hd] (model.qk_norm)                            [hd]
    model.layers.N.self_attn.o_proj.weight [d, h*hd] -> layers/attn/wo[N] [h, hd, d]
    model.layers.N.mlp.gate_proj / up_proj [f, d]    -> layers/mlp/w_gate_up[N] [d, 2, f]
    model.layers.N.mlp.down_proj.weight [d, f]       -> layers/mlp/w_down[N] [f, d]
    model.layers.N.input_layernorm.weight            -> layers/attn_norm/scale[N]
    model.layers.N.post_attention_layernorm.weight   -> layers/mlp_norm/scale[N]
      with model.post_norms (Gemma 2, modeling_gemma2.py), four norms a layer:
    model.layers.N.post_attention_layernorm.weight   -> layers/attn_post_norm/scale[N]
    model.layers.N.pre_feedforward_layernorm.weight  -> layers/mlp_norm/scale[N]
    model.layers.N.post_feedforward_layernorm.weight -> layers/mlp_post_norm/scale[N]
    model.norm.weight                                -> head/norm/scale
    lm_head.weight [vocab, d] (absent when tied)     -> head/w [d, vocab]

Query head q = g*r + j uses kv head g (transformers' repeat_kv), which is the order
of our fused groups. transformers applies RoPE in rotate-half form to q/k as stored
(its conversion script permuted Meta's interleaved weights once), and so does
`framework.model.rotary`, so no permutation is needed: tests/test_hf.py checks the
logits against transformers' own.

Import reads slices: every canonical leaf is placed with the sharding the run uses,
and for each of its process's devices only that device's block is read from the
memory-mapped files (framework/io/hf/safetensors.py), so a process holds its shards, not
the model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from framework.errors import ConfigError
from framework.config import ModelConfig
from framework.model import fp8_delayed
from framework.model.llama import init_params
from framework.model.prefix import is_moe_layer, unit_stacks
from framework.io.hf.family import (CONFIG_FILE, GENERATION_FILE,  # noqa: F401 (re-export)
                                    export_config, generation_config, is_hf_folder,
                                    merge_model, model_config, read_config)
from framework.io.hf import moe
from framework.io.hf.safetensors import Tensors, write_folder

TOKENIZER_FILE = "tokenizer.json"
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
LAYER = "model.layers.{}."


# --- Weights: HF tensors -> canonical leaves --------------------------------------------

def _bounds(sl: slice, n: int) -> tuple[int, int]:
    start, stop, step = sl.indices(n)
    assert step == 1, sl
    return start, stop


def layer_norms(cfg: ModelConfig) -> dict[str, str]:
    """Each layer norm of ours -> its HF name after `model.layers.N.` (module docstring)."""
    if cfg.has_post_norms:
        return {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm",
                "mlp_post_norm": "post_feedforward_layernorm"}
    return {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the HF layout with its shape, in file order."""
    d, f, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for n in range(cfg.n_layers):
        p = LAYER.format(n)
        norms = [p + f"{hf_name}.weight" for hf_name in layer_norms(cfg).values()]
        out.update({norms[0]: (d,),  # in the order Llama's folders hold them
                    p + "self_attn.q_proj.weight": (cfg.n_heads * hd, d),
                    p + "self_attn.k_proj.weight": (cfg.n_kv_heads * hd, d),
                    p + "self_attn.v_proj.weight": (cfg.n_kv_heads * hd, d),
                    p + "self_attn.o_proj.weight": (d, cfg.n_heads * hd),
                    **{name: (d,) for name in norms[1:]}})
        out.update(moe.expected(cfg, p) if is_moe_layer(cfg, n) else {
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f)})
        if cfg.has_qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (cfg.n_heads * hd,),
                        p + "self_attn.k_proj.bias": (cfg.n_kv_heads * hd,),
                        p + "self_attn.v_proj.bias": (cfg.n_kv_heads * hd,)})
        if cfg.has_qk_norm:
            out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    out["model.norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


# Tensors a folder may hold that no model reads: RoPE's cached frequencies (older
# transformers), the head of tied embeddings (some exports keep a copy).
HARMLESS = re.compile(r"(model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|lm_head\.weight)")


def check_tensors(tensors: Tensors, cfg: ModelConfig, where: str) -> None:
    """ConfigError (one line) unless the folder holds every tensor of `cfg`'s layout, of
    its shape, and no tensor that layout would drop (a Qwen2 folder labelled llama would
    lose its q/k/v biases, a Gemma 2 one its extra norms, without a word)."""
    expected = expected_tensors(cfg)
    unused = [n for n in tensors.where if n not in expected and not HARMLESS.fullmatch(n)]
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise ConfigError(f"{where} holds tensors that model.family={cfg.family} does not "
                          f"use ({', '.join(sorted(unused)[:3])}{more}): its config.json's "
                          f"model_type or settings do not describe these weights; fix "
                          f"config.json (q/k/v biases are qwen2's, q/k norms qwen3's, post "
                          f"norms gemma2's)")
    for name, shape in expected.items():
        if name not in tensors:
            raise ConfigError(f"{where}: tensor {name} is missing"
                              + (" (config.json says the embeddings are untied)"
                                 if name == "lm_head.weight" else ""))
        if tensors.shape(name) != shape:
            raise ConfigError(f"{where}: {name} is {list(tensors.shape(name))}, config.json "
                              f"implies {list(shape)}")


def leaf_readers(tensors: Tensors, cfg: ModelConfig) -> dict[tuple[str, ...], Callable]:
    """For each canonical leaf (by path), index -> float32 block of that leaf, reading
    only the rows/columns of the HF tensors the block is made of."""
    read = lambda name, index: tensors.read(name, index).astype(np.float32)
    readers = {
        ("embed", "table"): lambda index: read("model.embed_tokens.weight", index),
        ("head", "norm", "scale"): lambda index: read("model.norm.weight", index),
    }
    if not cfg.tie_embeddings:
        readers[("head", "w")] = lambda index: read("lm_head.weight", index[::-1]).T
    # the stack's own layers, a unit's dense layers, the prefix (prefix.py)
    for root, layer_cfg, count, start, stride in unit_stacks(cfg):
        readers.update({root + path: reader for path, reader in
                        _layer_readers(read, layer_cfg, start, count, stride).items()})
    return readers


def _at(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _layer_readers(read, cfg: ModelConfig, start: int, count: int, stride: int = 1) -> dict:
    """The leaf readers of a stack of `count` layers of `cfg`, HF layers start,
    start + stride, .. (paths below the stack's root)."""
    r, hd, kv = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim, cfg.n_kv_heads

    def per_layer(one):  # one(layer, rest of the index) -> block of that layer
        def block(index):
            lo, hi = _bounds(index[0], count)
            return np.stack([one(LAYER.format(start + n * stride), index[1:])
                             for n in range(lo, hi)])
        return block

    def groups(p, kind, g_sl, rest=()):  # q/k/v_proj.{kind} of kv groups g_sl
        g0, g1 = _bounds(g_sl, kv)  # rows of group g: q heads g*r..g*r+r-1, k_g, v_g
        parts = [read(p + f"self_attn.{w}_proj.{kind}", (slice(g0 * n * hd, g1 * n * hd),)
                      + rest).reshape(g1 - g0, n, hd, -1) for w, n in (("q", r), ("k", 1),
                                                                       ("v", 1))]
        return np.moveaxis(np.concatenate(parts, axis=1), 3, 0)  # [d' or 1, g, r+2, hd]

    def wqkv(p, index):  # [d, kv, r+2, hd]
        d_sl, g_sl, j_sl, h_sl = index
        return groups(p, "weight", g_sl, (d_sl,))[:, :, j_sl, h_sl]

    def qkv_bias(p, index):  # [kv, r+2, hd]
        g_sl, j_sl, h_sl = index
        return groups(p, "bias", g_sl)[0][:, j_sl, h_sl]

    def wo(p, index):  # [h, hd, d]
        h0, h1 = _bounds(index[0], cfg.n_heads)
        o = read(p + "self_attn.o_proj.weight", (index[2], slice(h0 * hd, h1 * hd)))
        return o.T.reshape(h1 - h0, hd, -1)[:, index[1], :]

    def w_gate_up(p, index):  # [d, 2, f]
        d_sl, c_sl, f_sl = index
        both = [read(p + f"mlp.{w}_proj.weight", (f_sl, d_sl)).T for w in ("gate", "up")]
        return np.stack(both, axis=1)[:, c_sl, :]

    norm = lambda key: lambda p, index: read(p + key, index)
    readers = {("attn", "wqkv"): per_layer(wqkv), ("attn", "wo"): per_layer(wo)}
    readers.update({path[1:]: reader for path, reader in moe.readers(
        cfg, read, per_layer, _bounds).items()} if cfg.moe.enabled else {
        ("mlp", "w_gate_up"): per_layer(w_gate_up),  # (experts: io/hf/moe.py)
        ("mlp", "w_down"): per_layer(
            lambda p, index: read(p + "mlp.down_proj.weight", index[::-1]).T)})
    for mine, theirs in layer_norms(cfg).items():
        readers[(mine, "scale")] = per_layer(norm(f"{theirs}.weight"))
    if cfg.has_qkv_bias:
        readers[("attn", "qkv_bias")] = per_layer(qkv_bias)
    if cfg.has_qk_norm:
        for w in "qk":
            readers[("attn", f"{w}_norm", "scale")] = per_layer(
                norm(f"self_attn.{w}_norm.weight"))
    return readers


def _key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    return tuple(_bounds(sl, n) for sl, n in zip(index, shape))


def read_shards(reader: Callable, shape: tuple[int, ...], sharding, devices) -> dict:
    """{device: its block of the leaf} for `devices`, reading each distinct block once
    (devices that replicate a block, e.g. over `data`, share the read)."""
    index_map = sharding.devices_indices_map(tuple(shape))
    blocks: dict[tuple, np.ndarray] = {}
    out = {}
    for device in devices:
        index = tuple(index_map[device]) + (slice(None),) * (len(shape) - len(index_map[device]))
        key = _key(index, shape)
        if key not in blocks:
            blocks[key] = reader(tuple(slice(a, b) for a, b in key))
        out[device] = blocks[key]
    return out


def canonical_shapes(cfg: ModelConfig):
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def load_params(folder: str | Path, cfg: ModelConfig, shardings, tensors: Tensors | None = None):
    """Canonical parameters (global float32 jax.Arrays with `shardings`, a tree like the
    canonical parameters) from a HF folder whose config.json gave `cfg`. Each process
    reads only the blocks of its own (addressable) devices."""
    tensors = tensors or Tensors(folder)
    check_tensors(tensors, cfg, str(folder))
    readers = leaf_readers(tensors, cfg)

    def place(path, shape, sharding):
        if fp8_delayed.is_history(path):  # (delayed FP8 scaling's: empty, not weights)
            return jax.jit(lambda: jnp.zeros(shape.shape, shape.dtype), out_shardings=sharding)()
        name = tuple(getattr(k, "key", k) for k in path)
        blocks = read_shards(readers[name], shape.shape, sharding, sharding.addressable_devices)
        if not all(np.isfinite(block).all() for block in blocks.values()):
            raise ConfigError(f"{folder}: the weights of {'/'.join(map(str, name))} hold NaN "
                              f"or Inf values: use a folder with finite weights")
        arrays = [jax.device_put(block, device) for device, block in blocks.items()]
        return jax.make_array_from_single_device_arrays(shape.shape, sharding, arrays)

    return jax.tree_util.tree_map_with_path(place, canonical_shapes(cfg), shardings)


# --- Weights: canonical leaves -> HF tensors (export) ---------------------------------

def hf_tensors(cfg: ModelConfig, params, dtype: str) -> list:
    """[(name, shape, dtype, make)] for safetensors_io.write_folder; `make()` builds one
    HF tensor from the canonical parameters (host or device arrays), one layer at a time."""
    makers = {"model.embed_tokens.weight": lambda: np.asarray(params["embed"]["table"], np.float32),
              "model.norm.weight": lambda: np.asarray(params["head"]["norm"]["scale"], np.float32)}
    if not cfg.tie_embeddings:
        makers["lm_head.weight"] = lambda: np.asarray(params["head"]["w"], np.float32).T
    for root, layer_cfg, count, start, stride in unit_stacks(cfg):  # (prefix.py)
        makers.update(_layer_makers(layer_cfg, _at(params, root), count, start, stride))
    np_dtype = EXPORT_DTYPES[dtype]
    return [(name, shape, np_dtype, lambda m=makers[name]: m().astype(np_dtype))
            for name, shape in expected_tensors(cfg).items()]


def _layer_makers(cfg: ModelConfig, layers, count: int, start: int, stride: int = 1) -> dict:
    """HF tensor name -> maker, for a stack of `count` layers of `cfg` (its params
    `layers` [count, ...]) written as HF layers start, start + stride, ..."""
    r = cfg.n_heads // cfg.n_kv_heads
    get = lambda leaf, n: np.asarray(leaf[n], dtype=np.float32)

    def qkv(n, j):  # j: slice of the group's rows (q heads, k, or v)
        w = get(layers["attn"]["wqkv"], n)[:, :, j, :]  # [d, kv, *, hd]
        return w.transpose(1, 2, 3, 0).reshape(-1, cfg.d_model)

    makers = {}
    for n in range(count):
        p = LAYER.format(start + n * stride)
        makers.update({p + f"{theirs}.weight": lambda n=n, mine=mine: get(
            layers[mine]["scale"], n) for mine, theirs in layer_norms(cfg).items()})
        makers.update({
            p + "self_attn.q_proj.weight": lambda n=n: qkv(n, slice(0, r)),
            p + "self_attn.k_proj.weight": lambda n=n: qkv(n, slice(r, r + 1)),
            p + "self_attn.v_proj.weight": lambda n=n: qkv(n, slice(r + 1, r + 2)),
            p + "self_attn.o_proj.weight":
                lambda n=n: get(layers["attn"]["wo"], n).reshape(-1, cfg.d_model).T})
        makers.update(moe.makers(cfg, layers["moe"], get, n, p) if cfg.moe.enabled else {
            p + "mlp.gate_proj.weight": lambda n=n: get(layers["mlp"]["w_gate_up"], n)[:, 0].T,
            p + "mlp.up_proj.weight": lambda n=n: get(layers["mlp"]["w_gate_up"], n)[:, 1].T,
            p + "mlp.down_proj.weight": lambda n=n: get(layers["mlp"]["w_down"], n).T})
        for w, j in (("q", slice(0, r)), ("k", slice(r, r + 1)), ("v", slice(r + 1, r + 2))):
            if cfg.has_qkv_bias:  # [kv, r+2, hd] -> rows (group, head, hd) as the weights'
                makers[p + f"self_attn.{w}_proj.bias"] = lambda n=n, j=j: get(
                    layers["attn"]["qkv_bias"], n)[:, j].reshape(-1)
            if cfg.has_qk_norm and w != "v":
                makers[p + f"self_attn.{w}_norm.weight"] = lambda n=n, w=w: get(
                    layers["attn"][f"{w}_norm"]["scale"], n)
    return makers


def export(out: str | Path, cfg: ModelConfig, params, dtype: str = "float32",
           extras: dict | None = None, max_positions: int = 2048,
           max_shard_bytes: int = 5 * 10**9, tokenizer: str | None = None) -> list[str]:
    """Writes a transformers-loadable folder of the model's family: config.json,
    generation_config.json, model.safetensors (or shards + index past
    `max_shard_bytes`) and, if given, a copy of `tokenizer` (tokenizer.json). Returns
    the files written."""
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    config = export_config(cfg, dtype, extras, max_positions)  # refuses before writing
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create {out}: {err.strerror or err}") from None
    files = write_folder(out, hf_tensors(cfg, params, dtype), max_shard_bytes)
    try:
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (out / GENERATION_FILE).write_text(json.dumps(generation_config(config), indent=2)
                                           + "\n")
        if tokenizer:
            (out / TOKENIZER_FILE).write_bytes(Path(tokenizer).read_bytes())
            files.append(TOKENIZER_FILE)
    except OSError as err:
        raise ConfigError(f"could not write into {out}: {err.strerror or err}") from None
    return [CONFIG_FILE, GENERATION_FILE, *files]
