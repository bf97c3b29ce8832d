"""What FP8 does to the layers' activations and output gradients, measured inside their
matmuls (`model.fp8`; the weights' statistics: `weight_stats`, at the end).

Each FP8 matmul y = x @ w (framework/model/weight_ops.py) quantizes its input x to E4M3
in the forward and its output gradient dy to E5M2 in the backward, each with its whole
tensor's scale. Where the train step hands the layer a zero probe (collection `PROBES`,
one [N_STATS] per matrix: framework/engine/fp8_probe.py), `observed` reports per
microbatch, as the probe's cotangent:

    [x: amax, saturated, underflow, elements, nonfinite,  dy: the same]

amax the whole tensor's absolute maximum (the one its quantization scales by),
saturated the elements at the format's largest magnitude once scaled, underflow the
nonzero elements that quantize to zero, elements the tensor's size, nonfinite its NaN
and infinite elements, the counts on this device's part (no collective beyond the
quantization's own maximum). Where the devices of the statistics' axes hold the same values
(an input replicated over `tensor`), each counts them: summed over the mesh, a matmul's
counts are then a multiple of the whole tensor's, the same multiple for each, so
its fractions are exact (which devices hold copies is not in the values' types: an
all-gathered tensor is typed as varying). The amax is the whole tensor's on every
device. The executors sum the probe's gradient over microbatches like a weight's (the
MoE router's statistics ride the same way: framework/engine/moe_stats.py).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from framework.model.fp8 import (E4M3, E5M2, STAT_PREFIX, _largest, in_format, is_matrix,
                                  quantize, scale_of)
from framework.parallel import vma

PROBES = "fp8_probes"  # the Flax collection of the probes, one per matrix
FIELDS = ("amax", "saturated", "underflow", "elements", "nonfinite")
N_STATS = 2 * len(FIELDS)  # the input's (E4M3), then the output gradient's (E5M2)


def tensor_stats(v, dtype, tp, scale=None):
    """[amax, saturated, underflow, elements, nonfinite] of v as `quantize(v, dtype)`
    scales it, or as its matmul does at `scale` (delayed scaling's, from the history)
    (module docstring): float32 [len(FIELDS)]."""
    v = jax.lax.stop_gradient(v)
    v32 = v.astype(jnp.float32)
    amax = tp.whole_max(jnp.max(jnp.abs(v32)))  # the one `quantize` scales by
    scale = scale_of(amax, dtype) if scale is None else jax.lax.stop_gradient(scale)
    q = in_format(v32, scale, dtype).astype(jnp.float32)
    saturated, underflow, nonfinite = _counts(
        jnp.abs(q) == _largest(dtype), (v32 != 0) & (q == 0), ~jnp.isfinite(v32))
    return jnp.stack([amax, saturated, underflow, jnp.float32(v.size), nonfinite])


def _counts(*flags):
    """How many elements each boolean array of one shape sets (float32), in one
    reduction: one kernel reads them together where separate sums made one each (the
    8B FP8 program's statistics, gpu:h100x8: docs/performance.md, FP8 matmuls)."""
    ones = [f.astype(jnp.float32) for f in flags]
    add = lambda a, b: tuple(x + y for x, y in zip(a, b))
    return jax.lax.reduce(tuple(ones), (jnp.float32(0),) * len(ones), add,
                          tuple(range(flags[0].ndim)))


def observed(x, y, probe, tp, given=None):
    """y, with the statistics of x (E4M3) and of y's cotangent (E5M2) as the probe's
    cotangent (module docstring); `given`: the scales [2] the matmul used in place of
    their current ones (`model.fp8=delayed`)."""
    x_scale = None if given is None else given[0]
    return _observed(tp, tensor_stats(x, E4M3, tp, x_scale), y, probe, given)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _observed(tp, x_stats, y, probe, given):
    return y


def _observed_fwd(tp, x_stats, y, probe, given):
    return y, (x_stats, probe, given)


def _observed_bwd(tp, residuals, dy):
    x_stats, probe, given = residuals
    stats = jnp.concatenate([x_stats, tensor_stats(dy, E5M2, tp,
                                                   None if given is None else given[1])])
    return (jnp.zeros_like(x_stats), dy, vma.like(stats, probe),
            None if given is None else jnp.zeros_like(given))


_observed.defvjp(_observed_fwd, _observed_bwd)


# --- The weights' statistics (outside the executors, once a step) -------------------

def _matrix_stats(w, dtype):
    """One layer's matrix w [...] as its matmuls quantize it (cast to the compute dtype
    `dtype`, then `quantize` to E4M3): (amax, elements at the largest finite E4M3
    magnitude, nonzero elements that quantize to zero)."""
    w = w.astype(dtype)
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)))
    # NaN where any element is not finite (a reduction's max may skip a NaN: XLA:CPU's)
    amax = jnp.where(jnp.all(jnp.isfinite(w)), amax, jnp.nan)
    w8 = quantize(w, E4M3, lambda v: v)[0].astype(jnp.float32)
    saturated = jnp.sum(jnp.abs(w8) == _largest(E4M3))
    underflow = jnp.sum((w != 0) & (w8 == 0))
    return amax, saturated, underflow


def weight_stats(stages: dict, dtype) -> dict:
    """The `fp8/` metrics of a step's layer weights (`stages`: the train layout's layer
    parameters, leaves [stage, chunk, layer, ...]), each matrix of each layer as one
    tensor, as its matmuls quantize it: the largest and smallest absolute maximum and
    scale (amax / 448) over the matrices, and the fractions of their elements at the
    E4M3 range's largest magnitude (saturated) and of nonzero elements flushed to zero
    (underflow). Uneven stages' zero padding layers are left out."""
    amaxes, saturated, underflow, elements = [], 0, 0, 0
    for path, w in jax.tree_util.tree_leaves_with_path(stages):
        if not is_matrix(path):
            continue
        per_layer = lambda m: _matrix_stats(m, dtype)  # vmapped, not reshaped: the
        for _ in range(3):  # sharded leading axes stay as they are
            per_layer = jax.vmap(per_layer)
        amax, sat, under = (a.reshape(-1) for a in per_layer(w))  # [stage * chunk * layer]
        real = amax != 0  # padding layers are zeros (a NaN counts as real)
        amaxes.append(amax)
        # summed in float32: an 8B model's elements overflow int32
        count = lambda c: jnp.sum(jnp.where(real, c, 0), dtype=jnp.float32)
        saturated, underflow = saturated + count(sat), underflow + count(under)
        elements = elements + count(1) * math.prod(w.shape[3:])
    amax = jnp.concatenate(amaxes)
    high = jnp.where(jnp.all(jnp.isfinite(amax)), jnp.max(amax), jnp.nan)
    low = jnp.min(jnp.where(amax != 0, amax, jnp.inf))
    largest, n = _largest(E4M3), jnp.maximum(elements, 1.0)
    return {STAT_PREFIX + "weight_amax_max": high, STAT_PREFIX + "weight_amax_min": low,
            STAT_PREFIX + "weight_scale_max": high / largest,
            STAT_PREFIX + "weight_scale_min": low / largest,
            STAT_PREFIX + "weight_saturated_fraction": saturated / n,
            STAT_PREFIX + "weight_underflow_fraction": underflow / n}
