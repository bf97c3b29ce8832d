"""The train step's `fp8/` activation and gradient metrics: what FP8 did to the inputs
and output gradients of the layers' matmuls over the step.

As the MoE router's statistics (framework/engine/moe_stats.py), they ride the gradient
of a zero probe: the step hands each layer one [N_STATS] probe per FP8 matrix (Flax
collection `fp8_stats.PROBES` beside the layer's params: this device's chunks
[v, Lc, N_STATS], typed like them), whose cotangent each matmul sets to its statistics
of the microbatch (framework/model/fp8_stats.py). The executors sum it over
microbatches (padding layers none); `reduce` sums it over the mesh; `take_probe`
removes it from the gradients before anything else sees them. A zero-bubble split
backward reports once: its W pass replays the matmuls on their saved inputs and pulls
their output gradients back, B's probe cotangent is dropped (weights are constants to
B).

The metrics (`metrics`), over the layers' FP8 matmuls (q/k/v, attention output,
gate/up, down) of the step:
  fp8/activation_amax_max, _min     the largest and smallest of the matmul inputs'
        absolute maxima, each the mean over the step's microbatches (a max does not
        sum over microbatches; the mean of the per-microbatch maxima does)
  fp8/activation_saturated_fraction the inputs' elements at E4M3's largest magnitude
        once scaled, a fraction of each matmul's over the step, averaged over the matmuls
  fp8/activation_underflow_fraction nonzero elements that quantize to zero, likewise
  fp8/gradient_amax_max, _min, fp8/gradient_saturated_fraction,
  fp8/gradient_underflow_fraction   the same of the output gradients in E5M2
A non-finite element makes its amax NaN (the run stops at that step: fp8.WATCHED).
Cost: per matmul and microbatch a pass over its input and its output gradient (no
collective but its quantization's maximum); a sum over the mesh of [v, Lc, matrices,
10] per step.

With `model.fp8=delayed` the exponents of the same tensors ride a second probe
(collection `fp8_delayed.EXPONENTS`, [v, Lc, 2 * BINS] per matrix, whatever
`model.fp8_stats` says: the scales of the next steps come from them), summed over the
mesh but `pipe`, and `update` rolls each layer's history parameter with them after the
optimizer's update (framework/model/fp8_delayed.py). The step that fills an empty
history scales currently: `with_probe(..., current=True)` marks its matmuls
(collection `fp8_delayed.CURRENT`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from framework.engine.resolved import Layout
from framework.model import fp8, fp8_delayed
from framework.model.fp8_delayed import BINS, CURRENT, EXPONENTS
from framework.model.fp8_stats import FIELDS, N_STATS, PROBES
from framework.parallel.mesh import CONTEXT, TENSOR
from framework.parallel.pipeline.comm import varying

KINDS = ("activation", "gradient")  # the input's statistics, then the output gradient's


def enabled(layout: Layout) -> bool:
    return layout.model.fp8 != "none" and (layout.model.fp8_stats or _delayed(layout))


def _delayed(layout: Layout) -> bool:
    return layout.model.fp8 == "delayed"


def _probes(params, layout: Layout, size: int):
    """A zero [v, Lc, size] float32 per FP8 matrix of this device's chunks."""
    def zero(path, w):
        if not fp8.is_matrix(path):
            return None
        # typed as varying over `tensor` too: each device reports its share of a matmul's
        # tensors (and with context parallelism, `context` is manual already)
        return varying(jnp.zeros(w.shape[:2] + (size,), jnp.float32),
                       tuple(dict.fromkeys(layout.vary_over + (TENSOR,))))

    return jax.tree_util.tree_map_with_path(zero, params)


def with_probe(params, layout: Layout, current: bool = False):
    """This device's params {'embed', 'head', 'chunks'}, the chunks as Flax variables
    with a zero probe [v, Lc, N_STATS] float32 per FP8 matrix in collection PROBES
    (`model.fp8_stats`), one [v, Lc, 2 * BINS] in EXPONENTS (`model.fp8=delayed`), and
    with `current` the marker CURRENT (this step scales currently)."""
    chunks = fp8.variables(params["chunks"])
    add = {PROBES: _probes(chunks["params"], layout, N_STATS)} if layout.model.fp8_stats \
        else {}
    if _delayed(layout):
        add[EXPONENTS] = _probes(chunks["params"], layout, 2 * BINS)  # (a vector: the
        # once-a-step weights cast a layer's matrices, framework/engine/step_weights.py)
    if current:
        add[CURRENT] = _probes(chunks["params"], layout, 1)
    return dict(params, chunks={**chunks, **add})


def take_probe(grads):
    """(gradients without the probes', the probes': this device's {'stats': {..: [v, Lc,
    N_STATS]}, 'exponents': {..: [v, Lc, 2 * BINS]}}, each where the step had it)."""
    chunks, mine = grads["chunks"], (PROBES, EXPONENTS, CURRENT)
    found = {name: chunks[key] for name, key in (("stats", PROBES), ("exponents", EXPONENTS))
             if key in chunks}
    return dict(grads, chunks={k: v for k, v in chunks.items() if k not in mine}), found


def reduce(probe_grad, layout: Layout):
    """This device's probe gradients -> the step's of its layers, each [1, v, Lc, ...]:
    the statistics' counts and the exponents' summed over the whole mesh but `pipe`
    (each device counted its part), the amaxes summed over the batch's axes (each
    replica's microbatches) and the same on each `context`/`tensor` device (whole
    already)."""
    amax = jnp.zeros(N_STATS, bool).at[jnp.array([0, len(FIELDS)])].set(True)

    def one(g, is_amax):
        summed = jax.lax.psum(g, layout.batch_axes)
        varies = jax.typeof(summed).manual_axis_type.varying
        same = tuple(a for a in (CONTEXT, TENSOR) if a in varies)
        if not same:
            return summed[None]
        return jnp.where(is_amax, jax.lax.pmax(summed, same), jax.lax.psum(summed, same))[None]

    out = {}
    if "stats" in probe_grad:
        out["stats"] = jax.tree.map(lambda g: one(g, amax), probe_grad["stats"])
    if "exponents" in probe_grad:
        out["exponents"] = jax.tree.map(lambda g: one(g, False), probe_grad["exponents"])
    return out


def mover(layout: Layout):
    """What the statistics move after the update: delayed scaling's histories, or None."""
    return update if _delayed(layout) else None


def update(params, found, layout: Layout):
    """The train layout's params with each delayed-scaling history rolled by the step's
    exponents (`found['exponents']`, [stages, v, Lc, 2 * BINS] per matrix)."""
    counts = found["exponents"]

    def one(path, leaf):
        if not fp8_delayed.is_history(path):
            return leaf
        node = counts
        for key in path[:-1]:
            node = node[key.key]
        found = node[path[-1].key[:-len(fp8_delayed.HISTORY)]]  # [stages, v, Lc, 2 * BINS]
        return fp8_delayed.rolled(leaf, found.reshape(found.shape[:-1] + (2, BINS)))

    return dict(params, stages=jax.tree_util.tree_map_with_path(one, params["stages"]))


def metrics(found, layout: Layout) -> dict:
    """The `fp8/` activation and gradient metrics from the step's statistics, each
    matrix's [stages, v, Lc, N_STATS] (`reduce`'s, gathered over `pipe`); none without
    them (`model.fp8_stats=false`)."""
    if "stats" not in found:
        return {}
    rows = jnp.concatenate([s.reshape(-1, N_STATS) for s in jax.tree.leaves(found["stats"])])
    uses = layout.parallel.data * layout.parallel.microbatches  # the step's microbatches
    out = {}
    for k, kind in enumerate(KINDS):
        amax, saturated, underflow, elements, nonfinite = (rows[:, k * len(FIELDS) + i]
                                                           for i in range(len(FIELDS)))
        real = elements > 0  # padding layers ran nothing
        mean = jnp.where(nonfinite > 0, jnp.nan, amax / uses)
        high = jnp.where(jnp.all(jnp.isfinite(jnp.where(real, mean, 0.0))),
                         jnp.max(jnp.where(real, mean, -jnp.inf)), jnp.nan)
        # each matmul's fractions (its counts are a multiple of its tensors', fp8_stats.py)
        fraction = lambda c: jnp.sum(jnp.where(real, c / jnp.maximum(elements, 1.0), 0.0)) \
            / jnp.maximum(jnp.sum(real), 1)
        prefix = f"{fp8.STAT_PREFIX}{kind}_"
        out.update({prefix + "amax_max": high,
                    prefix + "amax_min": jnp.min(jnp.where(real & (mean > 0), mean, jnp.inf)),
                    prefix + "saturated_fraction": fraction(saturated),
                    prefix + "underflow_fraction": fraction(underflow)})
    return out
