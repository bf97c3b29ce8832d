"""The router of a mixture-of-experts layer (framework/model/moe.py): its scores, which
experts each token goes to (`route`), the auxiliary losses and their gradient, and the
statistics the train step reports.

Auxiliary-loss-free balancing (DeepSeek-V3, DeepSeek-AI 2024b, section 2.1.2;
`model.moe.bias_update_rate` gamma > 0): each MoE layer holds a bias per expert
(`BIAS`, [E] float32, starting at 0) added to the scores for choosing the top-k only;
the chosen experts' weights are their unbiased scores. The bias takes no gradient (it
is read through stop_gradient, so AdamW leaves it where it is: a zero gradient moves
no Adam moment, and names ending in `_bias` are never decayed); after each optimizer
step `update_bias` moves it by gamma against each expert's load over the step's whole
batch: b_e += gamma * sign(mean load - load_e), lowering an overloaded expert's bias
and raising an underloaded one's. The loads are the step's router statistics
(framework/engine/moe_stats.py, summed over microbatches and data replicas), so every
layout moves it by the same amount as one device.

Switch Transformer (the load-balancing loss): Fedus et al. 2021. ST-MoE (router
z-loss): Zoph et al. 2022. DeepSeek-V3 (sigmoid router, routed_scaling_factor, the
sequence-wise balance loss's normalised scores, the balancing bias): DeepSeek-AI 2024b.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from framework.config import ModelConfig
from framework.model.layers import NO_TP
from framework.model.prefix import stack_layers
from framework.parallel.tensor import TensorParallel

BIAS = "score_bias"  # the auxiliary-loss-free balancing bias [E] (no gradient)
UNTRAINED = (BIAS,)  # layer weights the gradient never moves (the W pass may skip them)
LOAD = "expert_load"  # sown by each MoE layer: its token copies per expert [E] (reference.py)


def scores(router: str, logits):
    """logits [T, E] float32 -> the router's scores [T, E]: softmax over the experts, or
    each expert's sigmoid (DeepSeek-V3)."""
    return jax.nn.sigmoid(logits) if router == "sigmoid" else jax.nn.softmax(logits, axis=-1)


def balance_scores(router: str, logits):
    """The per-token distribution [T, E] whose mean over tokens is the load-balancing
    loss's P: the softmax; of sigmoid scores s, s / sum_e s (DeepSeek-V3's
    sequence-wise balance loss, section 2.1.2 of its report)."""
    s = scores(router, logits)
    return s / jnp.sum(s, axis=-1, keepdims=True) if router == "sigmoid" else s


def limits_groups(cfg: ModelConfig) -> bool:
    return cfg.moe.top_groups < cfg.moe.expert_groups


def in_top_groups(cfg: ModelConfig, choice):
    """Group-limited routing (DeepSeek-V3's n_group, topk_group; transformers'
    DeepseekV3TopkRouter): the experts in G consecutive groups, each group scored by the
    sum of its two best choice scores [T, E] (scores, + the balancing bias), and every
    expert outside a token's `top_groups` best groups given score -inf before the top-k
    (as DeepSeek-V3's own inference code; transformers fills 0, which a trained bias
    pushed below 0 would let the masked experts win)."""
    m = cfg.moe
    if not limits_groups(cfg):
        return choice
    t, e = choice.shape
    per_group = choice.reshape(t, m.expert_groups, e // m.expert_groups)
    best = jnp.sum(jax.lax.top_k(per_group, min(2, per_group.shape[-1]))[0], axis=-1)
    kept = jnp.sum(jax.nn.one_hot(jax.lax.top_k(best, m.top_groups)[1], m.expert_groups),
                   axis=1) > 0  # [T, G]
    return jnp.where(jnp.repeat(kept, e // m.expert_groups, axis=1), choice, -jnp.inf)


def route(cfg: ModelConfig, logits, bias=None):
    """logits [T, E] float32 -> (top-k weights [T, k] float32, expert ids [T, k] int32):
    the router's scores, the k largest (ties: the lower id; with the balancing `bias`
    [E], the k largest of scores + bias, and with expert groups among the top groups'
    experts only (`in_top_groups`), weighted by their scores), renormalised to sum 1
    where set, times routed_scale."""
    m = cfg.moe
    s = scores(m.router, logits)
    if bias is None and not limits_groups(cfg):
        weights, ids = jax.lax.top_k(s, m.top_k)
    else:
        choice = s if bias is None else s + jax.lax.stop_gradient(bias)
        ids = jax.lax.top_k(in_top_groups(cfg, choice), m.top_k)[1]
        weights = jnp.take_along_axis(s, ids, axis=-1)
    if m.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return (weights * m.routed_scale if m.routed_scale != 1.0 else weights), ids


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _with_loss_grad(router, logits, aux_weight, z_weight):
    return logits


def _with_loss_fwd(router, logits, aux_weight, z_weight):
    return logits, (logits, aux_weight, z_weight)


def _with_loss_bwd(router, saved, g):
    """g + d/dlogits of sum_t [sum_e p_te a_e + z lse_t^2] (p: `balance_scores`): a [E]
    and z [] constants."""
    logits, a, z = saved
    extra = lambda l: (jnp.sum(balance_scores(router, l) * a)
                       + z * jnp.sum(jax.nn.logsumexp(l, axis=-1) ** 2))
    return g + jax.grad(extra)(logits), None, None  # a, z: constants (no cotangent)


_with_loss_grad.defvjp(_with_loss_fwd, _with_loss_bwd)


def _hits(cfg: ModelConfig, logits, tp: TensorParallel, bias=None):
    """A group's top-k hits per expert [E] and its tokens T (this device's logits [T', E]
    float32; summed over the devices the group is split over)."""
    _, ids = route(cfg, logits, bias)
    count = tp.whole_sum(jnp.sum(jax.nn.one_hot(ids, logits.shape[-1]), axis=(0, 1)))
    return count, jnp.sum(count) / cfg.moe.top_k  # each token hits top_k (typed like logits)


def router_loss_values(cfg: ModelConfig, logits, tp: TensorParallel = NO_TP, bias=None):
    """The losses of one group's router logits [T, E] float32 (this device's tokens of
    it): (load-balancing loss E sum_e f_e P_e, f_e the fraction of tokens whose top-k
    holds e (no gradient, as transformers' one-hot), P_e the mean over tokens of
    `balance_scores` (the probability of e; of sigmoid scores, e's share of the token's
    sum); z-loss mean_t lse_t^2). `bias`: the balancing bias, which picks the top-k."""
    count, tokens = _hits(cfg, logits, tp, bias)
    f = jax.lax.stop_gradient(count / tokens)  # [E]: sums to top_k
    p = tp.whole_sum(jnp.sum(balance_scores(cfg.moe.router, logits), axis=0)) / tokens
    z = tp.whole_sum(jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)) / tokens
    return logits.shape[-1] * jnp.sum(f * p), z


def router_losses(cfg: ModelConfig, logits, tp: TensorParallel = NO_TP, bias=None):
    """logits [T, E] float32, unchanged; their gradient gains the auxiliary losses' (each
    coefficient over the groups and the MoE layers of a step: MoeConfig): per token,
    d/dp_te of the load-balancing loss is E f_e / T, of the z-loss's 2 lse_t / T."""
    m = cfg.moe
    if not (m.aux_loss_coef or m.z_loss_coef):
        return logits
    count, tokens = _hits(cfg, jax.lax.stop_gradient(logits), tp, bias)
    scale = 1.0 / (tp.groups * moe_layers(cfg) * tokens)
    aux_weight = m.aux_loss_coef * scale * logits.shape[-1] * count / tokens  # [E]
    return _with_loss_grad(m.router, logits, aux_weight, m.z_loss_coef * scale)


def router_stats(cfg: ModelConfig, logits, tp: TensorParallel = NO_TP, bias=None):
    """One group's router statistics [E + 3] float32 from this device's logits [T, E]:
    the top-k hits of each expert (token copies routed to it), the load-balancing and
    z losses (`router_loss_values`), and the copies dropped (0: routing is dropless)."""
    logits = jax.lax.stop_gradient(logits)
    count, _ = _hits(cfg, logits, tp, bias)
    aux, z = router_loss_values(cfg, logits, tp, bias)
    return jnp.concatenate([count, jnp.stack([aux, z, jnp.zeros_like(aux)])])


def moe_layers(cfg: ModelConfig) -> int:
    return stack_layers(cfg) if cfg.moe.enabled else 0


def update_bias(bias, counts, rate: float):
    """The balancing bias after a step (DeepSeek-V3 section 2.1.2): bias [..., E] + rate x
    sign(mean_e counts - counts), counts [..., E] the token copies each expert took over
    the step (a layer that took none, padding, is left as it is)."""
    mean = jnp.mean(counts, axis=-1, keepdims=True)
    return (bias + rate * jnp.sign(mean - counts)).astype(bias.dtype)


def n_stats(cfg: ModelConfig) -> int:
    """The statistics of one layer and group: hits per expert [E], aux, z, dropped."""
    return cfg.moe.experts + 3

