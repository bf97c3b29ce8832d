"""What FP8 does to the layers' activations and output gradients, measured inside their
matmuls (`model.fp8`; the weights' statistics: `fp8.weight_stats`).

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

from functools import partial

import jax
import jax.numpy as jnp

from framework.model.fp8 import E4M3, E5M2, _largest, in_format, scale_of
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
