"""Hugging Face Llama folders in and out: config.json <-> ModelConfig, and the weights
<-> the canonical parameter tree (framework/model/llama.py).

Name and layout map (transformers' LlamaForCausalLM; nn.Linear weights are [out, in]):

    model.embed_tokens.weight [vocab, d]          -> embed/table [vocab, d]
    model.layers.N.self_attn.q_proj.weight [h*hd, d] \\
                           k_proj.weight [kv*hd, d]   > layers/attn/wqkv[N] [d, kv, r+2, hd]:
                           v_proj.weight [kv*hd, d] /   group g = q heads g*r..g*r+r-1, k_g, v_g
    model.layers.N.self_attn.o_proj.weight [d, h*hd] -> layers/attn/wo[N] [h, hd, d]
    model.layers.N.mlp.gate_proj / up_proj [f, d]    -> layers/mlp/w_gate_up[N] [d, 2, f]
    model.layers.N.mlp.down_proj.weight [d, f]       -> layers/mlp/w_down[N] [f, d]
    model.layers.N.input_layernorm.weight            -> layers/attn_norm/scale[N]
    model.layers.N.post_attention_layernorm.weight   -> layers/mlp_norm/scale[N]
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

import dataclasses
import json
from pathlib import Path
from typing import Callable

import jax
import ml_dtypes
import numpy as np

from framework.errors import ConfigError
from framework.config import ModelConfig, RopeScaling
from framework.model.llama import init_params
from framework.model.rope import check_rope_scaling
from framework.io.hf.safetensors import Tensors, write_folder

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
# config.json key of each ModelConfig field the folder decides.
HF_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
           "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
           "d_ff": "intermediate_size", "rope_theta": "rope_theta",
           "rope_scaling": "rope_scaling", "norm_eps": "rms_norm_eps",
           "tie_embeddings": "tie_word_embeddings"}
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
LAYER = "model.layers.{}."


# --- config.json ----------------------------------------------------------------------

def is_hf_folder(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{folder} is not a Hugging Face model folder (no {CONFIG_FILE})")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return cfg


def rope_settings(hf: dict, where: str) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling: none or llama3) from either spelling: `rope_theta` +
    `rope_scaling` (published Llama 3 folders) or `rope_parameters` (newer transformers)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{where}: per-layer rope_parameters are not supported (Llama uses one)")
    if isinstance(params, dict) and params:
        theta, scaling = params.get("rope_theta", hf.get("rope_theta", 10000.0)), params
    else:
        theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), RopeScaling()
    if kind != "llama3":
        raise ConfigError(f"{where}: rope_type {kind!r} is not supported (default or llama3)")
    try:
        rope = RopeScaling(rope_type="llama3", factor=float(scaling["factor"]),
                           low_freq_factor=float(scaling["low_freq_factor"]),
                           high_freq_factor=float(scaling["high_freq_factor"]),
                           original_max_position_embeddings=int(scaling.get(
                               "original_max_position_embeddings",
                               hf.get("max_position_embeddings", 8192))))
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{where}: llama3 rope scaling lacks or mangles {err}") from None
    errs = check_rope_scaling(rope)
    if errs:
        raise ConfigError(f"{where}: {errs[0]}")
    return float(theta), rope


def _whole(hf: dict, key: str, where: str, default=None) -> int:
    """config.json's `key` as a whole number >= 1 (ConfigError naming it otherwise)."""
    value = hf.get(key) if hf.get(key) is not None else default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
            or value < 1:
        raise ConfigError(f"{where}: {key}={value!r} is not a whole number >= 1")
    return int(value)


def _positive(hf: dict, key: str, where: str, default: float = 1e-6) -> float:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{where}: {key}={value!r} is not a number > 0")
    return float(value)


def model_config(hf: dict, where: str = CONFIG_FILE, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of a transformers Llama config.json (dtype: our compute dtype)."""
    arch = hf.get("architectures") or []
    if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in arch:
        raise ConfigError(f"{where}: model_type {hf.get('model_type')!r} / architectures "
                          f"{arch} is not a Llama (LlamaForCausalLM)")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (only {want!r})")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads", "intermediate_size") if k not in hf]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    theta, scaling = rope_settings(hf, where)
    count = lambda key, default=None: _whole(hf, key, where, default)
    cfg = ModelConfig(
        vocab_size=count("vocab_size"), d_model=count("hidden_size"),
        n_layers=count("num_hidden_layers"), n_heads=count("num_attention_heads"),
        n_kv_heads=count("num_key_value_heads", count("num_attention_heads")),
        d_ff=count("intermediate_size"), rope_theta=theta, rope_scaling=scaling,
        norm_eps=_positive(hf, "rms_norm_eps", where),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype)
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != cfg.head_dim:
        raise ConfigError(f"{where}: head_dim={head_dim} differs from hidden_size/"
                          f"num_attention_heads={cfg.head_dim}, which this model requires")
    return cfg


def merge_model(given: dict, folder_cfg: ModelConfig, where: str) -> ModelConfig:
    """The folder's model settings, with the compute dtype from `given` (the model.*
    values the user or recipe set). Any other given value that differs from the
    folder's is a ConfigError naming both."""
    mine = dataclasses.asdict(folder_cfg)
    clashes = []
    for key, value in given.items():
        if key == "dtype" or key not in HF_KEYS:
            continue
        theirs = mine[key]
        if isinstance(value, RopeScaling):
            value = dataclasses.asdict(value)
            if value["rope_type"] == theirs["rope_type"] == "none":
                continue  # the other fields mean nothing without scaling
        if value != theirs:
            clashes.append(f"model.{key}={value} but {where} has {HF_KEYS[key]}={theirs}")
    if clashes:
        raise ConfigError("; ".join(clashes) + ": drop these settings (train.init_from "
                          "reads the model from config.json) or use another folder")
    return dataclasses.replace(folder_cfg, dtype=given.get("dtype", folder_cfg.dtype))


def export_config(cfg: ModelConfig, dtype: str, extras: dict | None = None,
                  max_positions: int = 2048) -> dict:
    """config.json for transformers' LlamaForCausalLM. `extras`: the config.json the
    weights were imported from, if any (keeps its token ids, context length, ...)."""
    out = {k: v for k, v in (extras or {}).items()
           if k not in ("rope_parameters", "rope_scaling", "dtype", "torch_dtype",
                        "transformers_version", "_name_or_path", "head_dim")}
    out.update({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype})
    out.setdefault("max_position_embeddings", max_positions)
    out.setdefault("bos_token_id", None)
    out.setdefault("eos_token_id", None)
    if cfg.rope_scaling.rope_type != "none":
        out["rope_scaling"] = dataclasses.asdict(cfg.rope_scaling)
    return dict(sorted(out.items()))


# --- Weights: HF tensors -> canonical leaves --------------------------------------------

def _bounds(sl: slice, n: int) -> tuple[int, int]:
    start, stop, step = sl.indices(n)
    assert step == 1, sl
    return start, stop


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the HF layout with its shape, in file order."""
    d, f, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for n in range(cfg.n_layers):
        p = LAYER.format(n)
        out.update({p + "input_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (cfg.n_heads * hd, d),
                    p + "self_attn.k_proj.weight": (cfg.n_kv_heads * hd, d),
                    p + "self_attn.v_proj.weight": (cfg.n_kv_heads * hd, d),
                    p + "self_attn.o_proj.weight": (d, cfg.n_heads * hd),
                    p + "post_attention_layernorm.weight": (d,),
                    p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                    p + "mlp.down_proj.weight": (d, f)})
    out["model.norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


def check_tensors(tensors: Tensors, cfg: ModelConfig, where: str) -> None:
    for name, shape in expected_tensors(cfg).items():
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
    r, hd, kv, L = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim, cfg.n_kv_heads, cfg.n_layers
    read = lambda name, index: tensors.read(name, index).astype(np.float32)

    def per_layer(one):  # one(layer, rest of the index) -> block of that layer
        def block(index):
            lo, hi = _bounds(index[0], L)
            return np.stack([one(LAYER.format(n), index[1:]) for n in range(lo, hi)])
        return block

    def wqkv(p, index):  # [d, kv, r+2, hd]
        d_sl, g_sl, j_sl, h_sl = index
        g0, g1 = _bounds(g_sl, kv)
        q = read(p + "self_attn.q_proj.weight", (slice(g0 * r * hd, g1 * r * hd), d_sl))
        q = q.reshape(g1 - g0, r, hd, -1).transpose(3, 0, 1, 2)  # [d', g, r, hd]
        kvs = [read(p + f"self_attn.{w}_proj.weight", (slice(g0 * hd, g1 * hd), d_sl))
               .reshape(g1 - g0, 1, hd, -1).transpose(3, 0, 1, 2) for w in "kv"]
        return np.concatenate([q, *kvs], axis=2)[:, :, j_sl, h_sl]

    def wo(p, index):  # [h, hd, d]
        h0, h1 = _bounds(index[0], cfg.n_heads)
        o = read(p + "self_attn.o_proj.weight", (index[2], slice(h0 * hd, h1 * hd)))
        return o.T.reshape(h1 - h0, hd, -1)[:, index[1], :]

    def w_gate_up(p, index):  # [d, 2, f]
        d_sl, c_sl, f_sl = index
        both = [read(p + f"mlp.{w}_proj.weight", (f_sl, d_sl)).T for w in ("gate", "up")]
        return np.stack(both, axis=1)[:, c_sl, :]

    norm = lambda key: lambda p, index: read(p + key, index)
    readers = {
        ("embed", "table"): lambda index: read("model.embed_tokens.weight", index),
        ("layers", "attn", "wqkv"): per_layer(wqkv),
        ("layers", "attn", "wo"): per_layer(wo),
        ("layers", "attn_norm", "scale"): per_layer(norm("input_layernorm.weight")),
        ("layers", "mlp", "w_gate_up"): per_layer(w_gate_up),
        ("layers", "mlp", "w_down"): per_layer(
            lambda p, index: read(p + "mlp.down_proj.weight", index[::-1]).T),
        ("layers", "mlp_norm", "scale"): per_layer(norm("post_attention_layernorm.weight")),
        ("head", "norm", "scale"): lambda index: read("model.norm.weight", index),
    }
    if not cfg.tie_embeddings:
        readers[("head", "w")] = lambda index: read("lm_head.weight", index[::-1]).T
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
    np_dtype = EXPORT_DTYPES[dtype]
    r = cfg.n_heads // cfg.n_kv_heads
    layers = params["layers"]
    get = lambda leaf, n: np.asarray(leaf[n], dtype=np.float32)

    def qkv(n, j):  # j: slice of the group's rows (q heads, k, or v)
        w = get(layers["attn"]["wqkv"], n)[:, :, j, :]  # [d, kv, *, hd]
        return w.transpose(1, 2, 3, 0).reshape(-1, cfg.d_model)

    makers = {"model.embed_tokens.weight": lambda: np.asarray(params["embed"]["table"], np.float32),
              "model.norm.weight": lambda: np.asarray(params["head"]["norm"]["scale"], np.float32)}
    if not cfg.tie_embeddings:
        makers["lm_head.weight"] = lambda: np.asarray(params["head"]["w"], np.float32).T
    for n in range(cfg.n_layers):
        p = LAYER.format(n)
        makers.update({
            p + "input_layernorm.weight": lambda n=n: get(layers["attn_norm"]["scale"], n),
            p + "self_attn.q_proj.weight": lambda n=n: qkv(n, slice(0, r)),
            p + "self_attn.k_proj.weight": lambda n=n: qkv(n, slice(r, r + 1)),
            p + "self_attn.v_proj.weight": lambda n=n: qkv(n, slice(r + 1, r + 2)),
            p + "self_attn.o_proj.weight":
                lambda n=n: get(layers["attn"]["wo"], n).reshape(-1, cfg.d_model).T,
            p + "post_attention_layernorm.weight": lambda n=n: get(layers["mlp_norm"]["scale"], n),
            p + "mlp.gate_proj.weight": lambda n=n: get(layers["mlp"]["w_gate_up"], n)[:, 0].T,
            p + "mlp.up_proj.weight": lambda n=n: get(layers["mlp"]["w_gate_up"], n)[:, 1].T,
            p + "mlp.down_proj.weight": lambda n=n: get(layers["mlp"]["w_down"], n).T})
    return [(name, shape, np_dtype, lambda m=makers[name]: m().astype(np_dtype))
            for name, shape in expected_tensors(cfg).items()]


def export(out: str | Path, cfg: ModelConfig, params, dtype: str = "float32",
           extras: dict | None = None, max_positions: int = 2048,
           max_shard_bytes: int = 5 * 10**9, tokenizer: str | None = None) -> list[str]:
    """Writes a transformers-loadable folder: config.json, model.safetensors (or shards
    + index past `max_shard_bytes`) and, if given, a copy of `tokenizer` (tokenizer.json).
    Returns the files written."""
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create {out}: {err.strerror or err}") from None
    files = write_folder(out, hf_tensors(cfg, params, dtype), max_shard_bytes)
    config = export_config(cfg, dtype, extras, max_positions)
    try:
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer:
            (out / TOKENIZER_FILE).write_bytes(Path(tokenizer).read_bytes())
            files.append(TOKENIZER_FILE)
    except OSError as err:
        raise ConfigError(f"could not write into {out}: {err.strerror or err}") from None
    return [CONFIG_FILE, *files]
