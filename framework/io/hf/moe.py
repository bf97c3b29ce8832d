"""Hugging Face mixtures of experts (`qwen3_moe`, `mixtral`, `qwen2_moe`): their
config.json's expert settings <-> `model.moe`, and their expert tensors <-> the canonical
MoE leaves (framework/model/moe.py). The rest of the layer is Llama's layout
(framework/io/hf/llama.py calls in here for the feed-forward). Checked against
transformers 5.24's `modeling_qwen3_moe.py`, `modeling_mixtral.py` and
`modeling_qwen2_moe.py`, whose `save_pretrained` writes one tensor per expert
(nn.Linear weights [out, in]):

    qwen3_moe: model.layers.N.mlp.gate.weight [E, d]               -> layers/moe/router[N]
                                                                      [d, E]
               model.layers.N.mlp.experts.e.gate_proj / up_proj     -> layers/moe/w_gate_up[N]
                   .weight [f, d]                                      [E, d, 2, f]
               model.layers.N.mlp.experts.e.down_proj.weight [d, f] -> layers/moe/w_down[N]
                                                                      [E, f, d]
    mixtral:   model.layers.N.block_sparse_moe.gate.weight, experts.e.w1 (gate), w3 (up),
               w2 (down): the same shapes
    qwen2_moe: qwen3_moe's, and the shared expert (model.moe.shared_experts 1,
               shared_hidden s, shared_gate):
               model.layers.N.mlp.shared_expert.gate_proj / up_proj -> layers/moe/
                   .weight [s, d]                                      shared_gate_up[N]
                                                                       [d, 2, s]
               model.layers.N.mlp.shared_expert.down_proj.weight    -> layers/moe/
                   [d, s]                                              shared_down[N] [s, d]
               model.layers.N.mlp.shared_expert_gate.weight [1, d]  -> layers/moe/
                                                                       shared_gate[N] [d, 1]

config.json: qwen3_moe's and qwen2_moe's num_experts (or num_local_experts),
num_experts_per_tok, moe_intermediate_size, norm_topk_prob (default false), the first
mlp_only_layers dense, which must be [0, ..., k-1] (model.moe.first_dense k: their MLP
intermediate_size wide, framework/model/prefix.py), and after them every
decoder_sparse_step-th layer sparse (model.moe.every: the dense layers first a multiple
of the step, the rest groups of it; other mlp_only_layers are not built); mixtral's num_local_experts, num_experts_per_tok, intermediate_size (its experts'
width), always renormalised, router_jitter_noise 0. qwen2_moe's shared expert is
shared_expert_intermediate_size wide and Qwen2MoeSparseMoeBlock adds
sigmoid(shared_expert_gate(x)) * shared_expert(x) to the routed experts' weighted sum:
model.moe.shared_gate's sum exactly (the gate's sigmoid taken in float32 here, in the
compute dtype there: the same in float32). router_aux_loss_coef is transformers'
training loss weight only where output_router_logits is true: read as
model.moe.aux_loss_coef then, else 0. No family here has a sigmoid router or a routed
scale (model.moe.router, routed_scale), and only qwen2_moe a shared expert: a
config.json that names DeepSeek's keys (or Qwen2-MoE's shared expert outside
qwen2_moe) is refused, and so is exporting or starting from a folder with settings its
family cannot hold (`HELD`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from framework.config import ModelConfig, MoeConfig
from framework.errors import ConfigError
from framework.model.moe import expert_hidden, set_away_from_default, shared_hidden
from framework.model.router import BIAS

# family -> (module of the feed-forward, gate, up, down)
LAYOUTS = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
           "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
           "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def is_moe(family: str) -> bool:
    return family in LAYOUTS


def _names(cfg: ModelConfig, p: str):
    """(router name, [(gate, up, down) per expert]) of layer prefix `p`."""
    module, gate, up, down = LAYOUTS[cfg.family]
    experts = [tuple(f"{p}{module}.experts.{e}.{w}.weight" for w in (gate, up, down))
               for e in range(cfg.moe.experts)]
    return f"{p}{module}.gate.weight", experts


def _shared_names(p: str):
    """((gate, up, down) of the shared expert, its gate) of layer prefix `p` (qwen2_moe)."""
    return (tuple(f"{p}mlp.shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")),
            f"{p}mlp.shared_expert_gate.weight")


def expected(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The feed-forward's tensors of layer prefix `p` with their shapes."""
    d, f = cfg.d_model, expert_hidden(cfg)
    router, experts = _names(cfg, p)
    out = {router: (cfg.moe.experts, d)}
    for gate, up, down in experts:
        out.update({gate: (f, d), up: (f, d), down: (d, f)})
    if cfg.moe.shared_experts:
        (gate, up, down), w_gate = _shared_names(p)
        s = shared_hidden(cfg)
        out.update({gate: (s, d), up: (s, d), down: (d, s), w_gate: (1, d)})
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

    def shared_gate_up(p, index):  # [d, 2, s]
        d_sl, c_sl, s_sl = index
        names = _shared_names(p)[0]
        return np.stack([read(names[j], (s_sl, d_sl)).T for j in (0, 1)], axis=1)[:, c_sl, :]

    out = {("layers", "moe", "router"): per_layer(router),
           ("layers", "moe", "w_gate_up"): per_layer(w_gate_up),
           ("layers", "moe", "w_down"): per_layer(w_down)}
    if cfg.moe.bias_update_rate:  # no folder here holds a balancing bias: it starts at 0
        out[("layers", "moe", BIAS)] = per_layer(
            lambda p, index: np.zeros(len(expert_ids(index[0])), np.float32))
    if cfg.moe.shared_experts:  # [s, d] and [d, 1]: the HF tensors transposed
        out.update({("layers", "moe", "shared_gate_up"): per_layer(shared_gate_up),
                    ("layers", "moe", "shared_down"): per_layer(
                        lambda p, index: read(_shared_names(p)[0][2], index[::-1]).T),
                    ("layers", "moe", "shared_gate"): per_layer(
                        lambda p, index: read(_shared_names(p)[1], index[::-1]).T)})
    return out


def makers(cfg: ModelConfig, moe_layers, get, n: int, p: str) -> dict:
    """HF tensor name -> maker, for layer n's feed-forward (llama.hf_tensors')."""
    router, experts = _names(cfg, p)
    out = {router: lambda: get(moe_layers["router"], n).T}
    for e, (gate, up, down) in enumerate(experts):
        out.update({gate: lambda e=e: get(moe_layers["w_gate_up"], n)[e, :, 0].T,
                    up: lambda e=e: get(moe_layers["w_gate_up"], n)[e, :, 1].T,
                    down: lambda e=e: get(moe_layers["w_down"], n)[e].T})
    if cfg.moe.shared_experts:
        (gate, up, down), w_gate = _shared_names(p)
        out.update({gate: lambda: get(moe_layers["shared_gate_up"], n)[:, 0].T,
                    up: lambda: get(moe_layers["shared_gate_up"], n)[:, 1].T,
                    down: lambda: get(moe_layers["shared_down"], n).T,
                    w_gate: lambda: get(moe_layers["shared_gate"], n).T})
    return out


def _count(hf: dict, key: str, where: str) -> int:
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key}={value!r} is not a whole number >= 1")
    return value


# config.json keys of shared experts and other routers (Qwen2-MoE, DeepSeek-V2/V3), with
# the value that says none: refused, except the family's own (SHARED_WIDTH)
NOT_THESE_FAMILIES = (("shared_expert_intermediate_size", 0), ("n_shared_experts", 0),
                      ("num_shared_experts", 0), ("scoring_func", "softmax"),
                      ("routed_scaling_factor", 1.0))
# the config.json key of a family's shared expert's width
SHARED_WIDTH = {"qwen2_moe": "shared_expert_intermediate_size"}
DENSE_FIRST = {"qwen3_moe": "mlp_only_layers", "qwen2_moe": "mlp_only_layers"}
# the config.json key of a family's MoE-every-k-th-layer step (model.moe.every)
SPARSE_STEP = {"qwen3_moe": "decoder_sparse_step", "qwen2_moe": "decoder_sparse_step"}
# config.json keys that must hold this value where present (null: absent), and why
ONLY = {"qwen3_moe": (), "qwen2_moe": (),
        "mixtral": (("router_jitter_noise", 0.0, "no router noise"),)}
# model.moe's settings that a folder's family decides (beside the experts' count, top_k,
# width, renormalisation), and the values each family's folders hold: qwen3_moe's and
# mixtral's MoeConfig's defaults (no shared experts, a softmax router, no routed scale);
# qwen2_moe's one sigmoid-gated shared expert, of any width (shared_hidden)
NOT_IN_FOLDERS = ("shared_experts", "shared_hidden", "shared_gate", "router", "routed_scale",
                  "expert_groups", "top_groups")
_DEFAULTS = {k: getattr(MoeConfig(), k) for k in NOT_IN_FOLDERS}
HELD = {"qwen3_moe": _DEFAULTS, "mixtral": _DEFAULTS,
        "qwen2_moe": {**{k: v for k, v in _DEFAULTS.items() if k != "shared_hidden"},
                      "shared_experts": 1, "shared_gate": True}}


def _dense_first(hf: dict, kind: str, where: str) -> int:
    """model.moe.first_dense from the folder's dense layers (Qwen's mlp_only_layers), which
    must be the first ones (framework/model/prefix.py)."""
    key = DENSE_FIRST.get(kind)
    layers = hf.get(key) if key else None
    if not layers:
        return 0
    if sorted(layers) != list(range(len(layers))):
        raise ConfigError(f"{where}: {key}={layers!r} is not supported (only the first layers "
                          f"dense, [0, 1, ..., k-1]: dense layers among MoE ones are not built)")
    return len(layers)


def _layer_groups(hf: dict, kind: str, where: str) -> dict:
    """model.moe's first_dense and every from Qwen's mlp_only_layers [0..k-1] and
    decoder_sparse_step s: layer i is MoE iff i >= k and (i + 1) % s == 0, which is this
    model's rule (framework/model/prefix.py) with first_dense k - k % s (the layers from
    there to k are dense under both) and every s, where the layers after first_dense
    split into groups of s."""
    k, key = _dense_first(hf, kind, where), SPARSE_STEP.get(kind)
    if key is None or hf.get(key) in (None, 1):
        return {"first_dense": k, "every": 1}
    step = _count(hf, key, where)
    rest = _count(hf, "num_hidden_layers", where) - (k - k % step)
    if rest % step:
        raise ConfigError(f"{where}: {key}={step} with {rest} layers after the first "
                          f"{k - k % step} is not supported (only groups of {step} layers "
                          f"each ending with its MoE layer: the last layers would be dense)")
    return {"first_dense": k - k % step, "every": step}


def settings(hf: dict, kind: str, where: str) -> MoeConfig:
    """model.moe of a MoE family's config.json (module docstring); a feature this model
    does not run is a one-line ConfigError naming it."""
    for key, none in NOT_THESE_FAMILIES:
        if key != SHARED_WIDTH.get(kind) and hf.get(key) not in (None, none):
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported for model_type "
                              f"{kind} ({_holds(kind)})")
    for key, want, why in ONLY[kind]:
        if hf.get(key) is not None and hf[key] != want:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (only {want!r}: "
                              f"{why})")
    # (Qwen's published folders say num_experts; transformers 5 may write num_local_experts)
    experts = _count(hf, "num_local_experts" if kind == "mixtral" or (
        "num_experts" not in hf and "num_local_experts" in hf) else "num_experts", where)
    hidden = _count(hf, "intermediate_size" if kind == "mixtral" else "moe_intermediate_size",
                    where)
    coef = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
    shared = _layer_groups(hf, kind, where)
    if kind in SHARED_WIDTH:  # one shared expert, gated (Qwen2MoeSparseMoeBlock)
        shared.update(shared_experts=1, shared_hidden=_count(hf, SHARED_WIDTH[kind], where),
                      shared_gate=True)
    return MoeConfig(experts=experts, top_k=_count(hf, "num_experts_per_tok", where),
                     expert_hidden=hidden,
                     renormalize=True if kind == "mixtral" else bool(hf.get("norm_topk_prob",
                                                                            False)),
                     aux_loss_coef=coef, **shared)


def export_fields(cfg: ModelConfig) -> dict:
    """config.json's expert fields for `cfg` (ConfigError where its family cannot say it)."""
    m = cfg.moe
    if not m.enabled:
        raise ConfigError(f"model.family={cfg.family} needs model.moe.experts >= 1 to export")
    if m.bias_update_rate:
        raise ConfigError(f"model.moe.bias_update_rate={m.bias_update_rate}: a {cfg.family} "
                          f"folder has no balancing bias (DeepSeek-V3's "
                          f"e_score_correction_bias), and the trained bias changes which "
                          f"experts each token goes to; export a run trained with "
                          f"model.moe.bias_update_rate=0")
    held = HELD[cfg.family]
    wrong = [k for k in held if getattr(m, k) != held[k]]
    _refuse([f"model.moe.{k}={getattr(m, k)}" for k in wrong], cfg.family,
            f"a {cfg.family} folder", "set " + " ".join(
                f"model.moe.{k}={str(held[k]).lower() if isinstance(held[k], bool) else held[k]}"
                for k in wrong))
    common = {"num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_coef,
              "output_router_logits": m.aux_loss_coef > 0}
    if cfg.family == "mixtral":
        if not m.renormalize or expert_hidden(cfg) != cfg.d_ff or m.first_dense or \
                m.every != 1:
            raise ConfigError("a mixtral folder renormalises the top-k weights, its experts "
                              "are model.d_ff wide and every layer is MoE: set "
                              "model.moe.renormalize=true, model.moe.expert_hidden=null, "
                              "model.moe.first_dense=0 and model.moe.every=1")
        return {**common, "num_local_experts": m.experts, "router_jitter_noise": 0.0}
    if m.first_dense % m.every:
        raise ConfigError(f"model.moe.first_dense={m.first_dense} is not a multiple of "
                          f"model.moe.every={m.every}: a {cfg.family} folder's "
                          f"decoder_sparse_step puts the MoE layers at (i + 1) % step == 0, "
                          f"which would move them")
    out = {**common, "num_experts": m.experts, "moe_intermediate_size": expert_hidden(cfg),
           "norm_topk_prob": m.renormalize, "decoder_sparse_step": m.every,
           "mlp_only_layers": list(range(m.first_dense))}
    if cfg.family in SHARED_WIDTH:
        out[SHARED_WIDTH[cfg.family]] = shared_hidden(cfg)
    return out


def _holds(kind: str) -> str:
    """What a folder of `kind` holds of NOT_IN_FOLDERS, in words."""
    return ("one sigmoid-gated shared expert and a softmax router" if kind in SHARED_WIDTH
            else "no shared experts and a softmax router")


def _refuse(named: list[str], kind: str, where: str, advice: str) -> None:
    """A one-line ConfigError naming the settings (`named`) `where` cannot hold, if any."""
    if named:
        raise ConfigError(f"{', '.join(named)}: {where} has {_holds(kind)} ({kind}); "
                          f"{advice}")


def _get(m, key: str):
    """model.moe's `key` from a MoeConfig or its dict (None where the dict lacks it)."""
    return m.get(key) if isinstance(m, dict) else getattr(m, key)


def merged(given: dict, folder_cfg: ModelConfig, where: str = "config.json") -> ModelConfig:
    """The folder's experts with the training settings the user gave (the loss
    coefficients, the capacity factor and the balancing bias's rate, which starts the
    bias at 0: not the checkpoint's); a setting of NOT_IN_FOLDERS, first_dense or every
    given (not its default) that differs from the folder's is refused."""
    mine = given.get("moe")
    if mine is None:
        return folder_cfg
    if not folder_cfg.moe.enabled:  # a dense folder: no MoE setting has anything to set
        named = [f"model.moe.{k}={v}"
                 for k, v in set_away_from_default(lambda k: _get(mine, k))]
        if named:
            raise ConfigError(f"{', '.join(named)}: {where} is a dense model (no experts); "
                              f"drop these settings")
        return folder_cfg
    theirs = folder_cfg.moe
    _refuse([f"model.moe.{k}={_get(mine, k)}" for k in NOT_IN_FOLDERS
             if _get(mine, k) is not None and _get(mine, k) not in (_DEFAULTS[k],
                                                                   getattr(theirs, k))],
            folder_cfg.family, where, "drop these settings (train.init_from reads them from "
            "config.json)")
    layers = [f"model.moe.{k}={_get(mine, k)} (the folder's {getattr(theirs, k)})"
              for k in ("first_dense", "every") if _get(mine, k) is not None
              and _get(mine, k) not in (getattr(MoeConfig(), k), getattr(theirs, k))]
    if layers:
        raise ConfigError(f"{', '.join(layers)}: {where} says which layers are MoE; drop "
                          f"these settings (train.init_from reads them from config.json)")
    coefs = {k: _get(mine, k) for k in ("aux_loss_coef", "z_loss_coef", "capacity_factor",
                                        "bias_update_rate")
             if _get(mine, k) is not None}
    return dataclasses.replace(folder_cfg, moe=dataclasses.replace(folder_cfg.moe, **coefs))
