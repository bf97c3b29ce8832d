"""The train step's `moe/` metrics: what each MoE layer's router did over the step.

The statistics ride the gradient. The pipeline executors (framework/parallel/pipeline/)
return a loss and gradients like the params, and no side output from inside a stage;
so the step hands every layer a zero probe [n_stats] beside its weights (`with_probe`:
this device's chunks [v, Lc, n_stats], typed like them), whose cotangent the router's
identity sets to the layer's statistics of the microbatch (framework/model/moe.py's
`_report`, a weight op: the zero-bubble W pass replays it, B does not, so a split
backward produces it once). The executors sum weight gradients over microbatches and
give padding layers and idle ticks none, so the probe's gradient is, per layer, the sum
over this replica's microbatches; `reduce` sums it over the data replicas. Every
schedule carries it unchanged, and nothing else sees it: the probe is made inside the
step and taken out of the gradients (`take_probe`) before they are reduced, so the
optimizer, clipping, the gradient norm, checkpoints and ZeRO/FSDP never hold it
(FSDP's per-use gathers pass it by: `without_probe`). The alternative, a second output
per microbatch threaded through every executor and its stash, would touch every
schedule; recounting outside the pipeline would cost a forward.

Every statistic sums over groups (a microbatch of a data replica), which is why they
can ride: per layer the top-k hits per expert, the load-balancing and z losses of each
group, and the dropped copies. From these the metrics (`metrics`):
  moe/load_max_over_mean/layer_<i>  the step's tokens routed to (global) layer i's busiest
        expert over the mean per expert (tokens x top_k / experts): 1 is balanced
  moe/load_max_over_mean            the largest of them
  moe/dropped_fraction              token copies dropped / routed, all layers (0 when
        dropless; past their experts' slots with a capacity factor, moe_slots.py)
  moe/aux_loss, moe/z_loss          the load-balancing loss (E sum_e f_e P_e) and the
        router z-loss (mean lse^2), each averaged over the groups and MoE layers, as
        their coefficients weigh them (MoeConfig); not part of train/loss.
The load is the step's over all its groups: max over summed counts, not the mean of
each group's max (a max does not sum).
Cost: per layer and microbatch the router's top-k counted again (XLA may share it with
the routing's), a sum over `data` of [v, Lc, experts + 3] float32 per device and its
gather over `pipe` for the metrics; a dense model's step is built without any of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from framework.engine.resolved import Layout
from framework.model.moe import STATS, moe_layers, n_stats
from framework.model.prefix import moe_layer_index
from framework.model.router import BIAS, update_bias
from framework.parallel.mesh import CONTEXT, TENSOR
from framework.parallel.pipeline.comm import varying
from framework.parallel.pipeline.layout import to_layers

PREFIX = "moe/"


def enabled(layout: Layout) -> bool:
    return layout.model.moe.enabled


def _moe_of(chunks) -> tuple[dict, object]:
    """(the chunks' MoE layer params, chunks with other ones in their place): the chunks
    are the params, or Flax variables {'params', ...} (FP8's collections beside them)."""
    if "params" in chunks:
        inner, rebuild = _moe_of(chunks["params"])
        return inner, lambda moe: dict(chunks, params=rebuild(moe))
    return chunks["moe"], lambda moe: dict(chunks, moe=moe)


def with_probe(params, layout: Layout, current: bool = False):
    """This device's params {'embed', 'head', 'chunks'} with a zero probe in each MoE
    layer's params: chunks['moe'][STATS] [v, Lc, n_stats] float32, typed like them
    (`current`: FP8's filling step, nothing to the routers)."""
    moe, rebuild = _moe_of(params["chunks"])
    v, lc = jax.tree.leaves(moe)[0].shape[:2]
    probe = varying(jnp.zeros((v, lc, n_stats(layout.model)), jnp.float32), layout.vary_over)
    return dict(params, chunks=rebuild(dict(moe, **{STATS: probe})))


def take_probe(grads):
    """(gradients without the probe's, the probe's: this device's [v, Lc, n_stats])."""
    moe, rebuild = _moe_of(grads["chunks"])
    rest = {k: v for k, v in moe.items() if k != STATS}
    return dict(grads, chunks=rebuild(rest)), moe[STATS]


def without_probe(gather):
    """One layer's gather (FSDP's, per use) that passes the probe by untouched."""
    if gather is None:
        return None

    def run(layer):
        if STATS not in layer.get("moe", {}):
            return gather(layer)
        moe = {k: v for k, v in layer["moe"].items() if k != STATS}
        gathered, rebuild = _moe_of(gather(dict(layer, moe=moe)))  # (FP8's: variables)
        return rebuild(dict(gathered, **{STATS: layer["moe"][STATS]}))

    return run


def reduce(probe_grad, layout: Layout):
    """This device's probe gradient [v, Lc, n] -> the step's statistics of its layers
    [1, v, Lc, n]: summed over the batch's axes (`data`, and `expert`: each of its
    devices routes its own rows); the same on each `context`/`tensor` device (each
    group's statistics are whole there already), typed so (a max changes nothing)."""
    summed = jax.lax.psum(probe_grad, layout.batch_axes)
    varies = jax.typeof(summed).manual_axis_type.varying
    same = tuple(a for a in (CONTEXT, TENSOR) if a in varies)
    return (jax.lax.pmax(summed, same) if same else summed)[None]


def metrics(stats, layout: Layout) -> dict:
    """The `moe/` metrics from the step's statistics in the stage layout [stages, v,
    Lc, n] (`reduce`'s, gathered over `pipe`)."""
    model = layout.model
    e, groups, layers = model.moe.experts, layout.microbatch_groups, moe_layers(model)
    per_layer = to_layers(stats, layout.v_shape, layout.stage_layers)  # [L, n]
    counts = per_layer[:, :e]
    ratio = jnp.max(counts, axis=1) / (jnp.sum(counts, axis=1) / e)  # [L]
    out = {f"{PREFIX}load_max_over_mean/layer_{moe_layer_index(model, i)}": ratio[i]
           for i in range(ratio.shape[0])}
    out[f"{PREFIX}load_max_over_mean"] = jnp.max(ratio)
    out[f"{PREFIX}dropped_fraction"] = jnp.sum(per_layer[:, e + 2]) / jnp.sum(counts)
    out[f"{PREFIX}aux_loss"] = jnp.sum(per_layer[:, e]) / (groups * layers)
    out[f"{PREFIX}z_loss"] = jnp.sum(per_layer[:, e + 1]) / (groups * layers)
    return out


def mover(layout: Layout):
    """What the statistics move after the update: the balancing bias, or None."""
    return balance if layout.model.moe.bias_update_rate else None


def balance(params, stats, layout: Layout):
    """The train layout's params with each MoE layer's balancing bias moved by the
    step's loads (framework/model/router.py's `update_bias`): the bias [stages, v, Lc,
    E] and the statistics [stages, v, Lc, n] are both in the stage layout, layer by
    layer; padding layers routed nothing and stay."""
    moe = params["stages"]["moe"]
    counts = stats[..., :layout.model.moe.experts]
    bias = update_bias(moe[BIAS], counts, layout.model.moe.bias_update_rate)
    return dict(params, stages=dict(params["stages"], moe=dict(moe, **{BIAS: bias})))
