"""Hugging Face mixtures of experts (`qwen3_moe`, `mixtral`): their config.json's expert
settings <-> `model.moe`, and their expert tensors <-> the canonical MoE leaves
(framework/model/moe.py). The rest of the layer is Llama's layout (framework/io/hf/llama.py
calls in here for the feed-forward). Checked against transformers 5.24's
`modeling_qwen3_moe.py` and `modeling_mixtral.py`, whose `save_pretrained` writes one
tensor per expert (nn.Linear weights [out, in]):

    qwen3_moe: model.layers.N.mlp.gate.weight [E, d]               -> layers/moe/router[N]
                                                                      [d, E]
               model.layers.N.mlp.experts.e.gate_proj / up_proj     -> layers/moe/w_gate_up[N]
                   .weight [f, d]                                      [E, d, 2, f]
               model.layers.N.mlp.experts.e.down_proj.weight [d, f] -> layers/moe/w_down[N]
                                                                      [E, f, d]
    mixtral:   model.layers.N.block_sparse_moe.gate.weight, experts.e.w1 (gate), w3 (up),
               w2 (down): the same shapes

config.json: qwen3_moe's num_experts (or num_local_experts), num_experts_per_tok,
moe_intermediate_size, norm_topk_prob (every layer sparse: decoder_sparse_step 1,
mlp_only_layers []); mixtral's num_local_experts, num_experts_per_tok,
intermediate_size (its experts' width), always renormalised, router_jitter_noise 0.
router_aux_loss_coef is
transformers' training loss weight only where output_router_logits is true: read as
model.moe.aux_loss_coef then, else 0. Neither family has shared experts or a sigmoid
router (model.moe.shared_experts, router, routed_scale): a config.json that names them
(Qwen2-MoE's and DeepSeek's keys) is refused, and so is exporting or starting from a
folder with them set.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from framework.config import ModelConfig, MoeConfig
from framework.errors import ConfigError
from framework.model.moe import expert_hidden

# family -> (module of the feed-forward, gate, up, down)
LAYOUTS = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
           "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def is_moe(family: str) -> bool:
    return family in LAYOUTS


def _names(cfg: ModelConfig, p: str):
    """(router name, [(gate, up, down) per expert]) of layer prefix `p`."""
    module, gate, up, down = LAYOUTS[cfg.family]
    experts = [tuple(f"{p}{module}.experts.{e}.{w}.weight" for w in (gate, up, down))
               for e in range(cfg.moe.experts)]
    return f"{p}{module}.gate.weight", experts


def expected(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The feed-forward's tensors of layer prefix `p` with their shapes."""
    d, f = cfg.d_model, expert_hidden(cfg)
    router, experts = _names(cfg, p)
    out = {router: (cfg.moe.experts, d)}
    for gate, up, down in experts:
        out.update({gate: (f, d), up: (f, d), down: (d, f)})
    return out


def readers(cfg: ModelConfig, read, per_layer, bounds) -> dict:
    """Canonical MoE leaf path -> its block reader (llama.leaf_readers' conventions)."""
    def expert_ids(sl):
        lo, hi = bounds(sl, cfg.moe.experts)
        return range(lo, hi)

    def router(p, index):  # [d, E]
        return read(_names(cfg, p)[0], index[::-1]).T

    def w_gate_up(p, index):  # [E, d, 2, f]
        e_sl, d_sl, c_sl, f_sl = index
        experts = _names(cfg, p)[1]
        return np.stack([np.stack([read(experts[e][j], (f_sl, d_sl)).T for j in (0, 1)],
                                  axis=1)[:, c_sl, :] for e in expert_ids(e_sl)])

    def w_down(p, index):  # [E, f, d]
        e_sl, f_sl, d_sl = index
        experts = _names(cfg, p)[1]
        return np.stack([read(experts[e][2], (d_sl, f_sl)).T for e in expert_ids(e_sl)])

    return {("layers", "moe", "router"): per_layer(router),
            ("layers", "moe", "w_gate_up"): per_layer(w_gate_up),
            ("layers", "moe", "w_down"): per_layer(w_down)}


def makers(cfg: ModelConfig, moe_layers, get, n: int, p: str) -> dict:
    """HF tensor name -> maker, for layer n's feed-forward (llama.hf_tensors')."""
    router, experts = _names(cfg, p)
    out = {router: lambda: get(moe_layers["router"], n).T}
    for e, (gate, up, down) in enumerate(experts):
        out.update({gate: lambda e=e: get(moe_layers["w_gate_up"], n)[e, :, 0].T,
                    up: lambda e=e: get(moe_layers["w_gate_up"], n)[e, :, 1].T,
                    down: lambda e=e: get(moe_layers["w_down"], n)[e].T})
    return out


def _count(hf: dict, key: str, where: str) -> int:
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key}={value!r} is not a whole number >= 1")
    return value


# config.json keys of shared experts and other routers (Qwen2-MoE, DeepSeek-V2/V3), with
# the value that says none: these families' layouts have no place for them
NOT_THESE_FAMILIES = (("shared_expert_intermediate_size", 0), ("n_shared_experts", 0),
                      ("num_shared_experts", 0), ("scoring_func", "softmax"),
                      ("routed_scaling_factor", 1.0))
# model.moe's settings a folder of these families cannot hold (beside their defaults)
NOT_IN_FOLDERS = ("shared_experts", "shared_hidden", "shared_gate", "router", "routed_scale")


def settings(hf: dict, kind: str, where: str) -> MoeConfig:
    """model.moe of a MoE family's config.json (module docstring); a feature this model
    does not run is a one-line ConfigError naming it."""
    for key, none in NOT_THESE_FAMILIES:
        if hf.get(key) not in (None, none):
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported for model_type "
                              f"{kind} (no shared experts, a softmax router)")
    unsupported = {"qwen3_moe": (("decoder_sparse_step", 1), ("mlp_only_layers", [])),
                   "mixtral": (("router_jitter_noise", 0.0),)}[kind]
    for key, want in unsupported:
        if hf.get(key, want) not in (want,) and not (want == 0.0 and hf.get(key) == 0):
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (only {want!r}: "
                              f"every layer a mixture of experts, no router noise)")
    # (Qwen3's published folders say num_experts; transformers 5 writes num_local_experts)
    experts = _count(hf, "num_experts" if kind == "qwen3_moe" and "num_experts" in hf
                     else "num_local_experts", where)
    hidden = _count(hf, "moe_intermediate_size" if kind == "qwen3_moe" else
                    "intermediate_size", where)
    coef = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
    return MoeConfig(experts=experts, top_k=_count(hf, "num_experts_per_tok", where),
                     expert_hidden=hidden,
                     renormalize=bool(hf.get("norm_topk_prob", False)) if kind == "qwen3_moe"
                     else True, aux_loss_coef=coef)


def export_fields(cfg: ModelConfig) -> dict:
    """config.json's expert fields for `cfg` (ConfigError where its family cannot say it)."""
    m = cfg.moe
    if not m.enabled:
        raise ConfigError(f"model.family={cfg.family} needs model.moe.experts >= 1 to export")
    _check_default(m, f"a {cfg.family} folder")
    common = {"num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_coef,
              "output_router_logits": m.aux_loss_coef > 0}
    if cfg.family == "mixtral":
        if not m.renormalize or expert_hidden(cfg) != cfg.d_ff:
            raise ConfigError("a mixtral folder renormalises the top-k weights and its "
                              "experts are model.d_ff wide: set model.moe.renormalize=true "
                              "and model.moe.expert_hidden=null")
        return {**common, "num_local_experts": m.experts, "router_jitter_noise": 0.0}
    return {**common, "num_experts": m.experts, "moe_intermediate_size": expert_hidden(cfg),
            "norm_topk_prob": m.renormalize, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _check_default(m, where: str) -> None:
    """A one-line ConfigError where `m` (a MoeConfig or its dict) sets what these
    families' folders cannot hold (NOT_IN_FOLDERS)."""
    default = MoeConfig()
    named = [f"model.moe.{k}={_get(m, k)}" for k in NOT_IN_FOLDERS
             if _get(m, k) is not None and _get(m, k) != getattr(default, k)]
    if named:
        raise ConfigError(f"{', '.join(named)}: {where} has no shared experts and a softmax "
                          f"router (qwen3_moe, mixtral); drop these settings")


def _get(m, key: str):
    """model.moe's `key` from a MoeConfig or its dict (None where the dict lacks it)."""
    return m.get(key) if isinstance(m, dict) else getattr(m, key)


def merged(given: dict, folder_cfg: ModelConfig, where: str = "config.json") -> ModelConfig:
    """The folder's experts with the training settings the user gave (the loss
    coefficients and the capacity factor: not the checkpoint's); settings the folder
    cannot hold are refused."""
    mine = given.get("moe")
    if mine is None or not folder_cfg.moe.enabled:
        return folder_cfg
    _check_default(mine, where)
    coefs = {k: _get(mine, k) for k in ("aux_loss_coef", "z_loss_coef", "capacity_factor")
             if _get(mine, k) is not None}
    return dataclasses.replace(folder_cfg, moe=dataclasses.replace(folder_cfg.moe, **coefs))
