"""Hugging Face config.json <-> ModelConfig, for each model family: the one place that
maps a family's config.json fields onto our settings and back.

Every family here is Llama's decoder (pre-norm RMSNorm, GQA with rotate-half RoPE,
a gated MLP), told apart by settings (`FAMILY_PRESETS` in framework/config/model.py) and by
its config.json, as transformers' modeling code reads it (checked against transformers
5.24's `modeling_{llama,qwen2,qwen3,mistral,gemma2}.py`):

    llama    LlamaForCausalLM    `attention_bias` would bias o_proj too, `mlp_bias`
                                 the MLP: both must be false
    qwen2    Qwen2ForCausalLM    q/k/v_proj always biased, o_proj never (qkv_bias);
                                 `use_sliding_window` (false in the published folders)
    qwen3    Qwen3ForCausalLM    q_norm/k_norm RMSNorms of head_dim before RoPE
                                 (qk_norm); `attention_bias` (all four) must be false;
                                 `head_dim` is its own (Qwen3-0.6B: 128, 1024 / 16 heads)
    mistral  MistralForCausalLM  Llama's layer; `sliding_window` on every layer (v0.1:
                                 4096), null from v0.2 on
    gemma2   Gemma2ForCausalLM   (1 + w) norms before and after each sublayer, GeGLU
                                 (`hidden_activation` gelu_pytorch_tanh), embeddings x
                                 sqrt(hidden_size), `query_pre_attn_scalar`,
                                 `attn_logit_softcapping`, `final_logit_softcapping`,
                                 `sliding_window` on the layers `layer_types` calls
                                 sliding (every layer but each k-th: a pattern)

`head_dim` is read in every family (transformers falls back to hidden_size /
num_attention_heads). Qwen's sliding window (on the layers from max_window_layers on)
is refused where it would cut attention short, and so is a `layer_types` that is not
a pattern, or any other field that changes the computation (a one-line ConfigError
naming it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from framework.config import FAMILIES as ALL_FAMILIES, FAMILY_PRESETS, PRESET_DEFAULTS
from framework.config import ModelConfig, RopeScaling
from framework.config.model import HfFamily
from framework.errors import ConfigError
from framework.io.hf import moe
from framework.model.rope import check_rope_scaling

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"

# model_type -> how its config.json reads: each family's record (framework/config/model.py).
FAMILIES: dict[str, HfFamily] = {name: family.hf for name, family in ALL_FAMILIES.items()}
# transformers' activation names -> model.activation
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types
# config.json key of each ModelConfig field the folder decides (the family's settings:
# its model_type).
HF_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
           "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
           "d_ff": "intermediate_size", "rope_theta": "rope_theta",
           "rope_scaling": "rope_scaling", "norm_eps": "rms_norm_eps",
           "tie_embeddings": "tie_word_embeddings", "family": "model_type",
           "qkv_bias": "model_type", "qk_norm": "model_type", "explicit_head_dim": "head_dim",
           "norm_plus_one": "model_type", "post_norms": "model_type",
           "activation": "model_type", "embed_scale": "model_type",
           "sliding_window": "sliding_window", "sliding_window_pattern": "layer_types",
           "query_pre_attn_scalar": "query_pre_attn_scalar",
           "attn_softcap": "attn_logit_softcapping",
           "final_softcap": "final_logit_softcapping"}
PRESETS = ("qkv_bias", "qk_norm", "norm_plus_one", "post_norms", "activation", "embed_scale")


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


def family_of(hf: dict, where: str) -> str:
    """The family of a config.json, by `model_type` (as transformers' Auto classes
    choose), else by `architectures`."""
    arch = hf.get("architectures") or []
    kind = hf.get("model_type")
    if kind is None:
        kind = next((k for k, f in FAMILIES.items() if f.architecture in arch), None)
    if kind not in FAMILIES:
        raise ConfigError(f"{where}: model_type {hf.get('model_type')!r} / architectures {arch} "
                          f"is not supported (only {', '.join(FAMILIES)})")
    return kind


def check_fields(hf: dict, kind: str, where: str) -> None:
    """ConfigError naming the first field whose value this model cannot run."""
    family = FAMILIES[kind]
    act = {v: k for k, v in HF_ACTIVATIONS.items()}[FAMILY_PRESETS[kind].get("activation",
                                                                            "silu")]
    for key, want in ((family.activation_key, act), *family.fixed.items()):
        if hf.get(key, want) != want:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (only {want!r})")
    if family.window_layers != "switch":
        return
    sliding = [t for t in hf.get("layer_types") or [] if t != FULL]
    if sliding:
        raise ConfigError(f"{where}: layer_types holds {sliding[0]!r}: only full attention is "
                          f"supported (no sliding-window attention)")
    window, positions = hf.get("sliding_window"), hf.get("max_position_embeddings")
    on = hf.get(family.window_switch, False) if family.window_switch else family.has_window
    if family.window_switch:  # qwen: the window is on the layers from max_window_layers
        below = hf.get("max_window_layers", 28)  # on (qwen2_moe: on some of those below)
        on = on and (below >= 1 if family.window_below else below < hf.get(
            "num_hidden_layers", 0))
    if on and window is not None and (positions is None or window < positions):
        raise ConfigError(f"{where}: sliding_window={window} (below max_position_embeddings="
                          f"{positions}) is not supported: only full attention (no "
                          f"sliding-window attention)")


def window_settings(hf: dict, kind: str, where: str) -> tuple:
    """(model.sliding_window, model.sliding_window_pattern) of a config.json: Mistral's
    window on every layer; Gemma 2's on the layers `layer_types` calls sliding (absent:
    transformers' default, layer i slides iff (i + 1) % 2), which must be all of them
    or all but every k-th; (None, 0) elsewhere (Qwen's window: check_fields)."""
    family, window = FAMILIES[kind], hf.get("sliding_window")
    if family.window_layers == "switch" or window is None:
        return None, 0
    window = _whole(hf, "sliding_window", where)
    if family.window_layers == "all":
        return window, 0
    n = _whole(hf, "num_hidden_layers", where)
    types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    full = [i for i, t in enumerate(types) if t == FULL]
    if len(full) == n:
        return None, 0
    odd = [t for t in types if t not in (SLIDING, FULL)]
    k = full[0] + 1 if full else 0
    if odd or len(types) != n or full != [i for i in range(n) if k and (i + 1) % k == 0] \
            or k == 1:
        raise ConfigError(f"{where}: layer_types {types} is not supported: every layer "
                          f"{SLIDING}, or all but every k-th (k >= 2) {FULL}")
    return window, k


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
    """The ModelConfig of a transformers config.json of one of FAMILIES (dtype: our
    compute dtype); the family's settings come from its preset."""
    kind = family_of(hf, where)
    check_fields(hf, kind, where)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads", "intermediate_size") if k not in hf]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    theta, scaling = rope_settings(hf, where)
    count = lambda key, default=None: _whole(hf, key, where, default)
    d, heads = count("hidden_size"), count("num_attention_heads")
    head_dim = count("head_dim", d // heads or 1)
    window, pattern = window_settings(hf, kind, where)
    scores = {}
    if FAMILIES[kind].gemma_scores:  # (null soft-caps: none; transformers' defaults else)
        cap = lambda key, default: None if hf.get(key, default) is None else _positive(
            hf, key, where, default)
        scores = dict(query_pre_attn_scalar=_positive(hf, "query_pre_attn_scalar", where, 256),
                      attn_softcap=cap("attn_logit_softcapping", 50.0),
                      final_softcap=cap("final_logit_softcapping", 30.0))
    return ModelConfig(
        vocab_size=count("vocab_size"), d_model=d, n_layers=count("num_hidden_layers"),
        n_heads=heads, n_kv_heads=count("num_key_value_heads", heads),
        d_ff=count("intermediate_size"), rope_theta=theta, rope_scaling=scaling,
        norm_eps=_positive(hf, "rms_norm_eps", where),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype, family=kind,
        explicit_head_dim=None if head_dim * heads == d else head_dim,
        sliding_window=window, sliding_window_pattern=pattern, **scores,
        **({"moe": moe.settings(hf, kind, where)} if moe.is_moe(kind) else {}))


def merge_model(given: dict, folder_cfg: ModelConfig, where: str) -> ModelConfig:
    """The folder's model settings, with the compute dtype and the loss's chunk
    (`loss_chunk`: how the run computes, not the model) from `given` (the model.* values
    the user or recipe set). Any other given value that differs from the folder's is a
    ConfigError naming both."""
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
        if key == "explicit_head_dim" and (value or folder_cfg.head_dim) == folder_cfg.head_dim:
            continue  # the same width, said or implied
        if key in PRESETS:
            if value is None:
                continue  # the family's, whichever it is
            theirs = folder_cfg.family_setting(key)
        if value != theirs:
            said = (f"model_type={folder_cfg.family} (so {key}={theirs})"
                    if HF_KEYS[key] == "model_type" and key != "family"
                    else f"{HF_KEYS[key]}={theirs}")
            clashes.append(f"model.{key}={value} but {where} has {said}")
    if clashes:
        raise ConfigError("; ".join(clashes) + ": drop these settings (train.init_from "
                          "reads the model from config.json) or use another folder")
    merged = moe.merged(given, folder_cfg, where)
    return dataclasses.replace(merged, **{k: given[k] for k in ("dtype", "loss_chunk")
                                          if k in given})


def check_exportable(cfg: ModelConfig) -> None:
    """ConfigError when the settings differ from what the family's config.json can say
    (e.g. q/k/v biases on a Llama: its attention_bias would bias o_proj too)."""
    if cfg.family not in FAMILIES:
        raise ConfigError(f"model.family={cfg.family!r} has no Hugging Face architecture "
                          f"(only {', '.join(FAMILIES)})")
    full = lambda family: {**PRESET_DEFAULTS, **FAMILY_PRESETS[family]}
    for name, preset in full(cfg.family).items():
        if cfg.family_setting(name) != preset:
            fits = [k for k in FAMILY_PRESETS
                    if all(cfg.family_setting(n) == v for n, v in full(k).items())]
            raise ConfigError(
                f"model.{name}={cfg.family_setting(name)} cannot be written as a {cfg.family} "
                f"({FAMILIES[cfg.family].architecture}) folder, whose {name} is {preset}"
                + (f": export it as model.family={fits[0]}" if fits else ""))
    family = FAMILIES[cfg.family]
    said = [f"model.{k}={getattr(cfg, k)}" for k in ("sliding_window", "sliding_window_pattern")
            if getattr(cfg, k) and (family.window_layers == "switch" or (
                family.window_layers == "all" and k == "sliding_window_pattern"))]
    said += [f"model.{k}={getattr(cfg, k)}" for k in ("query_pre_attn_scalar",
                                                      "attn_softcap", "final_softcap")
             if getattr(cfg, k) is not None and not family.gemma_scores]
    if said:
        raise ConfigError(f"{said[0]} cannot be written as a {cfg.family} "
                          f"({family.architecture}) folder, which has no such setting")


def export_config(cfg: ModelConfig, dtype: str, extras: dict | None = None,
                  max_positions: int = 2048) -> dict:
    """config.json for the family's transformers class. `extras`: the config.json the
    weights were imported from, if any (keeps its token ids, context length, ...)."""
    check_exportable(cfg)
    family = FAMILIES[cfg.family]
    out = {k: v for k, v in (extras or {}).items()
           if k not in ("rope_parameters", "rope_scaling", "dtype", "torch_dtype",
                        "transformers_version", "_name_or_path", "head_dim")}
    out.update({
        "architectures": [family.architecture], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype, **family.fixed})
    out[family.activation_key] = {v: k for k, v in HF_ACTIVATIONS.items()}[cfg.mlp_activation]
    if family.has_window:  # (qwen: full attention everywhere)
        out.update({"sliding_window": cfg.sliding_window, **({family.window_switch: False}
                                                            if family.window_switch else {})})
    if family.window_layers == "layer_types":
        out["layer_types"] = [FULL if cfg.global_layer(i) else SLIDING
                              for i in range(cfg.n_layers)]
    if family.gemma_scores:
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim  # null: head_dim^-1/2, the same
        out.update({"query_pre_attn_scalar": int(scalar) if scalar and scalar == int(scalar)
                    else scalar, "attn_logit_softcapping": cfg.attn_softcap,
                    "final_logit_softcapping": cfg.final_softcap})
    if moe.is_moe(cfg.family):
        out.update(moe.export_fields(cfg))
    out.setdefault("max_position_embeddings", max_positions)
    out.setdefault("bos_token_id", None)
    out.setdefault("eos_token_id", None)
    if cfg.rope_scaling.rope_type != "none":
        out["rope_scaling"] = dataclasses.asdict(cfg.rope_scaling)
    return dict(sorted(out.items()))


def generation_config(config: dict) -> dict:
    """generation_config.json beside an exported config.json: its token ids (what
    transformers' `save_pretrained` derives from the model config)."""
    out = {"_from_model_config": True}
    out.update({k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                if config.get(k) is not None})
    return out
