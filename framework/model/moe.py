"""A mixture-of-experts feed-forward (`model.moe`, framework/config/model.py's MoeConfig):
a router (softmax, or DeepSeek-V3's sigmoid: `route`) sends each token to its top-k of E
SwiGLU experts, and their outputs, weighted by the router's scores, are summed. Dropless:
every token reaches all of its top-k experts, as transformers' Qwen3MoeSparseMoeBlock and
MixtralSparseMoeBlock compute. With shared experts (DeepSeek-V2/V3, Qwen2-MoE) every
token also goes through one dense gated MLP (`shared_expert`), optionally gated by
sigmoid(x w_gate), added to that sum.

The experts' matmuls are grouped: the token copies (a token once per chosen expert) are
sorted by expert, and `jax.lax.ragged_dot` multiplies each expert's run of rows by its
weights (megablox-style; `MoE`). `dense_moe` beside it is the naive reference: every
expert on every token, weighted by a routing matrix that is zero off the top-k.

With a capacity factor c (`model.moe.capacity_factor`) each expert has C slots per
sequence and the layer is static (framework/model/moe_slots.py): a buffer [E, rows x C,
d], batched einsums, one all-to-all of it under expert parallelism. That is what a GPU
wants: XLA's GPU compiler (jaxlib 0.10.2) lowers `ragged_dot` to a dense dot over every
local expert's masked copy of the rows (`executed_rows`), the slots run c times the
routed FLOPs.

Tensor parallelism inside the experts as in the dense MLP: each expert's hidden width
is the logical axis `mlp` (split over `tensor` by the rules), gate/up column-parallel,
down row-parallel, one `exit` after the weighted sum. The shared expert's hidden width
is `mlp` too, inside the same `enter`/`exit` (its partial sums join the experts' before
the one all-reduce); its weights have no `experts` axis, so under expert parallelism
each device runs it on its own tokens and its gradients are summed over `data` and
`expert` like any dense parameter's (framework/parallel/data.py). The router runs on
this device's tokens (its slice of the sequence under sequence parallelism, like a norm)
and its logits are gathered with the tokens by `enter`.

The auxiliary losses enter the gradient where they arise (`router_losses`: an identity
whose backward adds the losses' gradient w.r.t. the router logits, as Megatron-LM's
MoEAuxLossAutoScaler does): nothing has to travel through the pipeline's stages beside
the activations. Both are statistics of one group of tokens, a microbatch of a data
replica (summed over the `tensor`/`context` devices it is split over: `whole_sum`),
averaged over the `tp.groups` groups of a step and the model's MoE layers.

The train step's `moe/` metrics (framework/engine/moe_stats.py) ride the gradient the
same way: where the layer's params hold a zero probe `STATS` (the step adds it; init,
decoding and the forward-only loss never see one), an identity's backward hands this
group's `router_stats` over as the probe's cotangent (`_report`). It is a weight op, so
the zero-bubble W pass, which replays the weight ops alone, produces it exactly once.

The router itself (scores, top-k, the auxiliary losses, the statistics and DeepSeek-V3's
auxiliary-loss-free balancing bias) is framework/model/router.py.

Switch Transformer: Fedus et al. 2021. ST-MoE (router z-loss): Zoph et al. 2022.
Mixtral: Jiang et al. 2024. Qwen3-MoE: Yang et al. 2025. DeepSeek-V2 (shared experts):
DeepSeek-AI 2024a. DeepSeek-V3 (sigmoid router, routed_scaling_factor, the
sequence-wise balance loss's normalised scores): DeepSeek-AI 2024b, section 2.1.2.
Qwen2-MoE's gated shared expert: transformers' Qwen2MoeSparseMoeBlock.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from framework.config import ModelConfig, MoeConfig
from framework.model.layers import NO_TP, gated, param
from framework.model.moe_slots import capacity, capacity_experts, dropped_copies, slots
from framework.model.router import (BIAS, LOAD, UNTRAINED, balance_scores,  # noqa: F401 (re-export)
                                    moe_layers, n_stats, route, router_loss_values,
                                    router_losses, router_stats, scores, update_bias)
from framework.model.weight_ops import IN_COMPUTE_DTYPE, weight_op
from framework.parallel import vma
from framework.parallel.tensor import TensorParallel


ROUTERS = ("softmax", "sigmoid")


def expert_hidden(cfg: ModelConfig) -> int:
    return cfg.moe.expert_hidden or cfg.d_ff


def fp8_dims(cfg: ModelConfig) -> dict:
    """The widths of a MoE's FP8 matrices beside the dense layers' ({} for a dense
    model): what FP8 GEMMs need in multiples of 16 (framework/model/fp8.py)."""
    if not cfg.moe.enabled:
        return {}
    dims = {"the experts' width": expert_hidden(cfg)}
    if cfg.moe.shared_experts:
        dims["the shared experts' width"] = shared_hidden(cfg)
    return dims


def shared_hidden(cfg: ModelConfig) -> int:
    """The shared expert's hidden width (0: none): shared_hidden, else shared_experts
    experts' widths side by side (DeepSeek-V2/V3's n_shared_experts x
    moe_intermediate_size)."""
    m = cfg.moe
    return (m.shared_hidden or m.shared_experts * expert_hidden(cfg)) if m.shared_experts else 0


def matrix_params(cfg: ModelConfig, active: bool = True) -> int:
    """Weights of one MoE layer's matmuls: the router, each expert's three matrices
    (`active`: the top_k a token uses; else all of them), the shared expert's three and
    its gate's (every token uses them). The parameter and FLOP counts read this."""
    m, d = cfg.moe, cfg.d_model
    routed = routed_params(cfg) if active else m.experts * 3 * d * expert_hidden(cfg)
    shared = 3 * d * shared_hidden(cfg) + (d if m.shared_experts and m.shared_gate else 0)
    return d * m.experts + routed + shared


def routed_params(cfg: ModelConfig) -> int:
    """Weights of one MoE layer's routed experts a token uses: its top_k experts' three
    matrices each."""
    return cfg.moe.top_k * 3 * cfg.d_model * expert_hidden(cfg)


def executed_rows(cfg: ModelConfig, seq: int, dense_ragged_dot: bool) -> float:
    """Expert rows a compiled MoE layer multiplies per routed token copy: with a capacity
    factor its slots, E C per sequence of s k copies (about c); dropless, 1 where the
    compiler runs `ragged_dot` as a grouped matmul, and E where it expands it into a
    dense dot of every received row against every local expert (`dense_ragged_dot`:
    framework/hardware.py's `expands_ragged_dot`: E/P local experts times the worst-case
    receive buffer's P N rows). Checked against compiled GPU programs in
    tests/compiled/test_moe_gpu.py (docs/configuration.md has the figures)."""
    m = cfg.moe
    if not m.enabled:
        return 1.0
    if m.capacity_factor is not None:
        return m.experts * capacity(cfg, seq) / (seq * m.top_k)
    return float(m.experts) if dense_ragged_dot else 1.0


def _ragged(x_and_sizes, w):
    """x [N, d] (rows sorted by expert), group sizes [E] -> x @ w[e] per run: [N, f]."""
    x, sizes = x_and_sizes
    return jax.lax.ragged_dot(x, w.reshape(w.shape[0], w.shape[1], -1), sizes)


def grouped_experts(module, cfg: ModelConfig, x, weights, ids, w_in, w_down):
    """The experts on their tokens, grouped: x [T, d], weights/ids [T, k], w_in [E, d, 2,
    f@tensor], w_down [E, f@tensor, d] -> [T, d] (partial sums over `tensor`)."""
    t, k = ids.shape
    flat = ids.reshape(-1)  # [T k]: token i's j-th expert at i k + j
    if module.tp.expert.runs:
        out = _dispatched(module, cfg, x, flat, w_in, w_down).reshape(t, k, -1)
        return jnp.einsum("tkd,tk->td", out, weights.astype(out.dtype))
    order = jnp.argsort(flat, stable=True)  # copies sorted by expert
    sizes = jnp.zeros((w_in.shape[0],), jnp.int32).at[flat].add(1)  # [E]
    out = _expert_mlp(module, cfg, x[order // k], sizes, w_in, w_down)  # [T k, d]
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(t, k, -1)  # [T, k, d]
    return jnp.einsum("tkd,tk->td", unsorted, weights.astype(out.dtype))


def _expert_mlp(module, cfg: ModelConfig, rows, sizes, w_in, w_down):
    """rows [N, d] sorted by expert, sizes [E] the experts' runs (rows past them:
    output zero) -> each row through its expert's SwiGLU [N, d], one ragged_dot each."""
    gate_up = weight_op(module, "w_gate_up", _ragged, (rows, sizes), w_in)  # [N, 2 f]
    hidden = gated(cfg, gate_up.reshape(gate_up.shape[0], 2, -1))  # [N, f]
    return weight_op(module, "w_down", _ragged, (hidden, sizes), w_down)  # [N, d]


def _dispatched(module, cfg: ModelConfig, x, flat, w_in, w_down):
    """Expert parallelism (framework/parallel/expert.py): x [T, d], flat [T k] global
    expert ids; w_in/w_down this device's experts -> the copies' outputs [T k, d],
    each computed on the device holding its expert."""
    ep, local, k = module.tp.expert, w_in.shape[0], flat.shape[0] // x.shape[0]
    rows, ids, state = ep.dispatch(jnp.repeat(x, k, axis=0), flat, local)
    order = jnp.argsort(ids, stable=True)  # received copies by local expert, padding last
    sizes = jnp.zeros((local,), jnp.int32).at[ids].add(1, mode="drop")
    out = _expert_mlp(module, cfg, rows[order], sizes, w_in, w_down)
    return ep.combine(jnp.zeros_like(out).at[order].set(out), state)


def shared_expert(module, cfg: ModelConfig, x):
    """The shared expert on every token: x [T, d] (entered: the whole sequence) -> [T, d]
    (partial sums over `tensor`): a gated MLP of width `shared_hidden`, gate/up
    [embed, 2, mlp] column-parallel, down [mlp, embed] row-parallel (the dense MLP's
    layout, without its own enter/exit: framework/model/layers.py's MLP), times
    sigmoid(x w_gate) with `shared_gate` (w_gate [embed, 1], replicated)."""
    dt, f = x.dtype, shared_hidden(cfg)
    w_in = param(module, "shared_gate_up", (cfg.d_model, 2, f), ("embed", "gate_up", "mlp"))
    w_down = param(module, "shared_down", (f, cfg.d_model), ("mlp", "embed"))
    gate_up = weight_op(module, "shared_gate_up", "td,dcf->tcf", x, w_in.astype(dt))
    out = weight_op(module, "shared_down", "tf,fd->td", gated(cfg, gate_up), w_down.astype(dt))
    if not cfg.moe.shared_gate:
        return out
    w_gate = param(module, "shared_gate", (cfg.d_model, 1), ("embed", "shared_gate"))
    logit = weight_op(module, "shared_gate", "td,do->to", x, w_gate.astype(dt),
                      IN_COMPUTE_DTYPE)  # [T, 1]: a gate, in the compute dtype
    return out * jax.nn.sigmoid(logit.astype(jnp.float32)).astype(dt)


def dense_moe(cfg: ModelConfig, x, weights, ids, w_in, w_down, rows: int = 1):
    """The naive reference of `grouped_experts` and `capacity_experts` (same arguments):
    every expert on every token, [E, T, ...], weighted by a routing matrix [T, E] zero
    off each token's top-k and where a capacity factor drops the copy."""
    if cfg.moe.capacity_factor is not None:
        slot, c = slots(cfg, ids, rows)
        weights = jnp.where(slot < rows * c, weights, 0.0)
    hidden = gated(cfg, jnp.einsum("td,edcf->etcf", x, w_in))  # [E, T, f]
    out = jnp.einsum("etf,efd->etd", hidden, w_down)
    routing = jnp.sum(jax.nn.one_hot(ids, w_in.shape[0]) * weights[..., None], axis=1)
    return jnp.einsum("etd,te->td", out, routing.astype(out.dtype))


STATS = "stats"  # the train step's probe of the router statistics (engine/moe_stats.py)


@jax.custom_vjp
def _report(stats_and_zero, probe):
    """(stats, a zero scalar), the probe -> that zero; the probe's cotangent is `stats`
    whatever the zero's (which the caller adds to the logits, so that the backward runs)."""
    return stats_and_zero[1]


def _report_fwd(stats_and_zero, probe):
    return stats_and_zero[1], vma.like(stats_and_zero[0], probe)


def _report_bwd(stats, g):
    return (None, g), stats  # the statistics themselves: constants


_report.defvjp(_report_fwd, _report_bwd)


class MoE(nn.Module):
    """The mixture-of-experts feed-forward: router [embed, router_experts] (replicated),
    experts' fused gate/up [experts, embed, 2, mlp] and down [experts, mlp, embed] (`mlp`
    split over `tensor` like the dense MLP's, `experts` over `expert` with expert
    parallelism), and with shared experts `shared_expert`'s. `dense` runs the naive
    reference of the routed experts."""

    cfg: ModelConfig
    tp: TensorParallel = NO_TP
    dense: bool = False

    @nn.compact
    def __call__(self, x):  # x: [batch, seq (/tensor with SP), embed]
        c, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        e, f = c.moe.experts, expert_hidden(c)
        # the router's expert axis is not `experts`: every device scores every expert
        w_router = param(self, "router", (c.d_model, e), ("embed", "router_experts"))
        w_in = param(self, "w_gate_up", (e, c.d_model, 2, f),
                     ("experts", "embed", "gate_up", "mlp"))
        w_down = param(self, "w_down", (e, f, c.d_model), ("experts", "mlp", "embed"))
        # the auxiliary-loss-free balancing bias [E] (router.py): no gradient
        bias = param(self, BIAS, (e,), ("router_experts",), nn.initializers.zeros) \
            if c.moe.bias_update_rate else None
        logits = weight_op(self, "router", "bsd,de->bse", x.astype(dt), w_router.astype(dt),
                           IN_COMPUTE_DTYPE)  # (the router stays in the compute dtype)
        b, s_local = logits.shape[:2]
        logits = router_losses(c, logits.astype(jnp.float32).reshape(b * s_local, e), self.tp,
                               bias)
        probe = self.has_variable("params", STATS)  # the train step's (moe_stats.py)
        stats = router_stats(c, logits, self.tp, bias) if probe else None
        logits = self.tp.enter(logits.reshape(b, s_local, e), "mlp")  # [b, s, E]
        # [b, s, embed], typed as varying over `tensor` here: f's backward all-reduce
        # runs once on it, not on the experts' copies of it and the shared expert's input
        xs = self.tp.varies(self.tp.enter(x.astype(dt), "mlp"), "mlp")
        weights, ids = route(c, logits.reshape(-1, e), bias)  # [b s, k]
        self.sow("intermediates", LOAD, jnp.sum(jax.nn.one_hot(ids, e), axis=(0, 1)))
        if probe:  # the statistics ride the probe's gradient (`_report`)
            stats = stats.at[e + 2].set(dropped_copies(c, ids, b))
            zero = vma.like(jnp.zeros((), jnp.float32), weights)
            weights = weights + weight_op(self, STATS, _report, (stats, zero),
                                          self.get_variable("params", STATS))
        tokens = xs.reshape(-1, c.d_model)
        args = (tokens, weights, ids, w_in.astype(dt), w_down.astype(dt))
        if self.dense:
            y = dense_moe(c, *args, rows=b)
        elif c.moe.capacity_factor is not None:
            y = capacity_experts(self, c, *args, rows=b)
        else:
            y = grouped_experts(self, c, *args)
        if c.moe.shared_experts:
            y = y + shared_expert(self, c, tokens)
        return self.tp.exit(y.reshape(xs.shape), "mlp")  # [b, s (/tensor with SP), embed]


MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")


def _group_errors(m) -> list[str]:
    """Group-limited routing's settings (router.py's `in_top_groups`), one line each."""
    if m.expert_groups < 1 or m.experts % m.expert_groups:
        return [f"model.moe.expert_groups={m.expert_groups} must divide model.moe.experts="
                f"{m.experts} (1: no groups)"]
    if not 1 <= m.top_groups <= m.expert_groups:
        return [f"model.moe.top_groups={m.top_groups} must be in [1, model.moe.expert_groups="
                f"{m.expert_groups}]"]
    if m.top_groups < m.expert_groups and m.top_k > m.top_groups * (m.experts // m.expert_groups):
        return [f"model.moe.top_k={m.top_k} is more than the experts of "
                f"model.moe.top_groups={m.top_groups} groups of "
                f"{m.experts // m.expert_groups}"]
    return []


def set_away_from_default(get) -> list[tuple[str, object]]:
    """(name, value) of each model.moe setting away from its default; `get(name)`: its
    value (a MoeConfig's, or None where a dict of given settings lacks it)."""
    default = MoeConfig()
    return [(f.name, get(f.name)) for f in dataclasses.fields(default)
            if get(f.name) is not None and get(f.name) != getattr(default, f.name)]


def _dense_errors(m) -> list[str]:
    """MoE settings given to a dense model (model.moe.experts 0), which nothing would
    read: one line naming them, rather than a run that silently ignores them."""
    given = [f"{k}={v}" for k, v in set_away_from_default(lambda k: getattr(m, k))]
    return [f"model.moe.{', '.join(given)} set on a dense model (model.moe.experts=0): set "
            f"model.moe.experts >= 1 for a mixture of experts, or leave them unset"] if given else []


def check_moe(model: ModelConfig) -> list[str]:
    """Problems of the mixture-of-experts settings, one line each."""
    m, errs = model.moe, []
    if m.experts < 0 or (model.family in MOE_FAMILIES and m.experts < 1):
        errs.append(f"model.moe.experts={m.experts} must be >= 1"
                    + (f" (model.family={model.family} is a mixture of experts)"
                       if model.family in MOE_FAMILIES else " (0: a dense feed-forward)"))
    if not m.enabled:
        return errs or _dense_errors(m)
    if not 1 <= m.top_k <= m.experts:
        errs.append(f"model.moe.top_k={m.top_k} must be in [1, model.moe.experts={m.experts}]")
    if m.expert_hidden is not None and m.expert_hidden < 1:
        errs.append(f"model.moe.expert_hidden={m.expert_hidden} must be >= 1 (null: model.d_ff)")
    for name in ("aux_loss_coef", "z_loss_coef"):
        if getattr(m, name) < 0:
            errs.append(f"model.moe.{name}={getattr(m, name)} must be >= 0")
    if m.capacity_factor is not None and not m.capacity_factor > 0:
        errs.append(f"model.moe.capacity_factor={m.capacity_factor} must be > 0 (null: "
                    f"dropless)")
    if not 0 <= m.first_dense < model.n_layers:
        errs.append(f"model.moe.first_dense={m.first_dense} must be in [0, model.n_layers="
                    f"{model.n_layers}) (the dense layers before the MoE ones)")
    elif m.every < 1 or (model.n_layers - m.first_dense) % m.every:
        errs.append(f"model.moe.every={m.every} must be >= 1 and divide model.n_layers - "
                    f"model.moe.first_dense={model.n_layers - m.first_dense} (each group of "
                    f"`every` layers ends with its MoE layer)")
    elif m.every > 1 and model.sliding_window_pattern:
        errs.append(f"model.moe.every={m.every} with model.sliding_window_pattern="
                    f"{model.sliding_window_pattern} is not supported (a unit's layers share "
                    f"one window): use model.moe.every=1 or one window for every layer")
    if m.shared_experts < 0:
        errs.append(f"model.moe.shared_experts={m.shared_experts} must be >= 0 (0: none)")
    if m.shared_hidden is not None and m.shared_hidden < 1:
        errs.append(f"model.moe.shared_hidden={m.shared_hidden} must be >= 1 (null: "
                    f"model.moe.shared_experts x the experts' width)")
    elif m.shared_experts == 0 and (m.shared_hidden is not None or m.shared_gate):
        errs.append(f"model.moe.shared_hidden={m.shared_hidden}, shared_gate={m.shared_gate} "
                    f"need shared experts (model.moe.shared_experts >= 1)")
    if m.router not in ROUTERS:
        errs.append(f"model.moe.router={m.router!r} is not one of {', '.join(ROUTERS)}")
    if m.routed_scale <= 0:
        errs.append(f"model.moe.routed_scale={m.routed_scale} must be > 0")
    errs += _group_errors(m)
    if m.bias_update_rate < 0:
        errs.append(f"model.moe.bias_update_rate={m.bias_update_rate} must be >= 0 (0: no "
                    f"balancing bias)")
    if model.fp8 != "none" and m.capacity_factor is None:
        errs.append(f"model.fp8={model.fp8} with model.moe needs a capacity factor (its "
                    f"slots' batched matmuls run in FP8; the dropless experts' ragged_dot "
                    f"has no FP8 path): set model.moe.capacity_factor (e.g. 1.25) or use "
                    f"model.fp8=none")
    return errs
