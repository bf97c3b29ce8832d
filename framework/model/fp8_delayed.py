"""Delayed FP8 scaling (`model.fp8=delayed`): each matmul's input and output gradient
scaled by what earlier steps saw, not by their own absolute maximum.

Current scaling (`tensorwise`, framework/model/fp8.py) reads a tensor once for its
absolute maximum, reduces that over the tensor devices, and only then casts it: on one
H200 those passes cost the 8B stage nearly what FP8's GEMMs saved (docs/performance.md,
FP8 matmuls). With a scale known before the tensor exists, the cast needs no maximum
and no collective, and the compiler may fuse it into the producer. Delayed scaling
(Micikevicius et al. 2022, section 4.3; TransformerEngine's `DelayedScaling`) keeps,
per matrix and layer, a history of the last H steps' absolute maxima of its input x and
output gradient dy (`model.fp8_history`), and scales each by the largest:

    s = 2^e,  e the smallest integer with amax_history_max <= largest * 2^e

Scales are powers of two: dividing by one is exact, and a scale depends on a maximum
only through its exponent, which travels exactly (below).

The history is a layer parameter per FP8 matrix, `<name>_fp8_history` float32 [2, H]
(x's row, then dy's; 0: no step measured), which no gradient moves (`is_history`:
no weight decay, not a weight the split backward's W pass must reach): it
is laid out, sharded, gathered and checkpointed as the layer's weights are. The step
measures each matmul's exponents per microbatch on a zero probe (collection
`EXPONENTS`, one [2 * BINS] per matrix), its cotangent a one-hot of x's exponent and
of dy's (`observed`): summed over microbatches, data replicas, tensor and context
devices (each device's shard its own maximum), the highest bin with a count is the
whole step's exponent, the same on every layout. `rolled` then shifts the history and
enters `largest * 2^e` (engine: framework/engine/fp8_probe.py).

The first step has no history: it runs with current scaling and fills it (the engine's
filling program, marked by collection `CURRENT`), as does the first step after
resuming from a checkpoint without one. A history all zeros otherwise scales by 1.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from framework.model.fp8 import E4M3, E5M2, _largest, in_format
from framework.parallel import vma

HISTORY = "_fp8_history"  # a matrix's history parameter: f"{name}{HISTORY}" [2, H]
EXPONENTS = "fp8_exponents"  # the Flax collection of the exponent probes
CURRENT = "fp8_current"  # present: this step scales currently (the filling step)
FORMATS = (E4M3, E5M2)  # x's, then dy's
LOWEST, BINS = -96, 128  # the exponents a probe counts: LOWEST .. LOWEST + BINS - 1


def history_name(name: str) -> str:
    return f"{name}{HISTORY}"


def is_history(path) -> bool:
    """Whether a parameter tree's leaf at `path` is a delayed-scaling history."""
    return str(getattr(path[-1], "key", path[-1])).endswith(HISTORY)


def _largests():
    return jnp.array([_largest(f) for f in FORMATS], jnp.float32)  # [2]


def scales(history):
    """[..., 2, H] -> the scales [..., 2] of x and dy: the history's largest entry over
    its format's largest finite value (a power of two: entries are largest * 2^e), 1
    where no step was measured."""
    top = jnp.max(history.astype(jnp.float32), axis=-1)
    return jnp.where(top > 0, top / _largests(), 1.0)


def exponent(amax, dtype):
    """The smallest integer e with amax <= largest(dtype) * 2^e (int32), exactly: the
    frexp of the ratio is within one of it and each candidate is checked by an exact
    product."""
    largest = _largest(dtype)
    _, k = jnp.frexp(amax.astype(jnp.float32) / largest)
    fits = lambda e: amax <= jnp.ldexp(jnp.float32(largest), e)  # (exact; exp2 is not)
    e = jnp.where(fits(k - 1), k - 1, jnp.where(fits(k), k, k + 1))
    return e.astype(jnp.int32)


def one_hot(amax, dtype):
    """[BINS] float32: 1 at amax's exponent (clipped to the bins), nothing where amax is
    0 (nothing to scale) or not finite (the step's loss says so)."""
    e = jnp.clip(exponent(amax, dtype), LOWEST, LOWEST + BINS - 1) - LOWEST
    counted = (amax > 0) & jnp.isfinite(amax)
    return jnp.where(counted & (jnp.arange(BINS) == e), 1.0, 0.0).astype(jnp.float32)


def rolled(history, counts):
    """The history [..., 2, H] after a step whose exponent counts are `counts`
    [..., 2, BINS]: shifted by one, the step's bound largest * 2^e_max first (0 where
    nothing was counted)."""
    bins = jnp.arange(BINS, dtype=jnp.int32) + LOWEST
    counted = jnp.any(counts > 0, axis=-1)
    e = jnp.max(jnp.where(counts > 0, bins, LOWEST), axis=-1)  # [..., 2]
    bound = jnp.where(counted, jnp.ldexp(_largests(), e), 0.0)
    return jnp.concatenate([bound[..., None].astype(history.dtype), history[..., :-1]], -1)


def observed(x, y, probe):
    """y, with the one-hots of x's exponent (E4M3) and of y's cotangent's (E5M2), each
    from this device's part of the tensor, as the probe's cotangent [2 * BINS]."""
    return _observed(_counted(x, E4M3), y, probe)


def _counted(v, dtype):
    v = jax.lax.stop_gradient(v)
    return one_hot(jnp.max(jnp.abs(v.astype(jnp.float32))), dtype)


@jax.custom_vjp
def _observed(x_bins, y, probe):
    return y


def _observed_fwd(x_bins, y, probe):
    return y, (x_bins, probe)


def _observed_bwd(residuals, dy):
    x_bins, probe = residuals
    counts = jnp.concatenate([x_bins, _counted(dy, E5M2)])  # [2 * BINS]: flat, as a
    return jnp.zeros_like(x_bins), dy, vma.like(counts, probe)  # vector is never cast


_observed.defvjp(_observed_fwd, _observed_bwd)


def sends_e4m3(model) -> bool:
    """Whether a tensor on its way to a matmul travels as E4M3 at its delayed scale
    (`sent_in_e4m3`; a MoE's slots under expert parallelism): `model.fp8=delayed` and
    `model.fp8_dispatch` (the filling step, whose scales are not yet measured, sends
    them in the compute dtype: the caller's `weight_ops.sent_scale` says when)."""
    return getattr(model, "fp8", "none") == "delayed" and bool(model.fp8_dispatch)


def sent_in_e4m3(send, back, x, scale):
    """send(x), x travelling as E4M3 (one byte an element): cast at `scale`, the delayed
    scale of the matmul x goes to (a power of two, known before x exists), sent, and
    multiplied back by it in x's dtype, which holds E4M3 values times a power of two
    exactly; that matmul's own cast at the same scale then recovers the values sent. So
    the numbers are those of sending x itself (a MoE's slots on their way to their
    experts' devices: framework/model/moe_slots.py). The gradient passes straight
    through, in x's dtype: back(dy), `back` the transpose of `send` (a permutation).
    x's exponent must be counted before the cast (after it no value can exceed the
    scale): the caller observes x, not what arrives."""
    return _sent(send, back, x, scale)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sent(send, back, x, scale):
    # E4M3's bits as uint8 on the wire: XLA:CPU widens a float8 collective to float16
    # (2026-12-01: an all-to-all of f16 in the compiled program); integers go as they are
    bits = jax.lax.bitcast_convert_type(in_format(x.astype(jnp.float32), scale, E4M3),
                                        jnp.uint8)
    got = jax.lax.bitcast_convert_type(send(bits), E4M3)
    return (got.astype(jnp.float32) * scale).astype(x.dtype)


def _sent_fwd(send, back, x, scale):
    return _sent(send, back, x, scale), scale


def _sent_bwd(send, back, scale, dy):
    return back(dy), jnp.zeros_like(scale)


_sent.defvjp(_sent_fwd, _sent_bwd)


def _histories(stages):
    return [h for path, h in jax.tree_util.tree_leaves_with_path(stages) if is_history(path)]


def empty(stages) -> bool:
    """Whether no history of the train layout's layer parameters holds a measured step
    (a fresh model, or one restored from a run without delayed scaling): read once, on
    the host, before a run's first step."""
    return not any(bool(jnp.any(h != 0)) for h in _histories(stages))


def scale_metrics(stages) -> dict:
    """The `fp8/` metrics of the scales the histories give the next step: the largest and
    smallest over the layers' matmuls, of their inputs' (activation) and of their
    output gradients' (gradient); 1 where a history is empty."""
    used = jnp.concatenate([scales(h).reshape(-1, 2) for h in _histories(stages)])  # [n, 2]
    out = {}
    for k, kind in enumerate(("activation", "gradient")):
        out[f"fp8/{kind}_scale_max"] = jnp.max(used[:, k])
        out[f"fp8/{kind}_scale_min"] = jnp.min(used[:, k])
    return out
