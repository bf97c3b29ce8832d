"""FP8 matmuls with per-tensor current scaling (`model.fp8=tensorwise`).

A layer's matmul y = einsum(eq, x, w) runs on float8 operands (Micikevicius et al. 2022,
"FP8 Formats for Deep Learning"): the forward's x and w in E4M3 (3 mantissa bits,
largest finite 448), the backward's output gradient dy in E5M2 (2 mantissa bits,
largest finite 57344: gradients span a wider range), every product accumulated in
float32 and the result cast to the compute dtype. Each operand is scaled into its
format's range by its own absolute maximum in the same step ("current scaling", as
Megatron-LM/TransformerEngine's `Float8CurrentScaling`):

    s_x = amax(|x|) / 448,  x8 = E4M3(x / s_x),  y = (x8 @ w8) * s_x * s_w

The absolute maximum is the whole tensor's, not a device's shard: the tensor-parallel
plan reduces it over the axes the tensor is split over (`TensorParallel.whole_max`), so
an FP8 run on any layout computes what it computes on one device with the same
microbatches; a weight's maximum also over the expert devices a MoE's experts are split
over (`TensorParallel.weight_max`: one scale for all of a layer's experts). The
backward: dx = dy8 @ w8^T and dw = x8^T @ dy8, from the forward's quantized x8 and w8
(kept as the residuals: a quarter of float32's bytes) and dy8 at its own scale. Norms,
the embedding, the head and the loss stay in the compute dtype
(`framework/model/weight_ops.py` applies this to the layers' matrices only). With
`model.fp8=delayed` the scales of x and dy are given (`given`), from earlier steps'
maxima (framework/model/fp8_delayed.py); the weights keep their current scale.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from framework.config import CHOICES
from framework.parallel.vma import alike

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# The name of an FP8 matmul's output (scaled, in the compute dtype), which `save_dots`
# keeps in place of the float32 product of its FP8 operands (framework/model/stack.py)
PRODUCT = "fp8_product"
MODES = CHOICES["model.fp8"]
# cuBLASLt's FP8 GEMMs take matrix dimensions that are multiples of 16 (NVIDIA's FP8
# requirements; XLA's GEMM rewriter leaves other shapes to a slower path).
GEMM_MULTIPLE = 16


def _largest(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def _scale(amax):
    """The factor that maps a tensor's absolute maximum onto the format's largest
    finite value (1 where the tensor is all zeros)."""
    return jnp.where(amax > 0, amax, 1.0)


def quantize(x, dtype, whole_max):
    """(x in `dtype` scaled into its range, the scale s: x ~ x8 * s). `whole_max` reduces
    a scalar to the whole tensor's (the plan's max over the axes x is split over)."""
    # a statistic, never differentiated (the autodiff executor linearizes the forward
    # around this custom VJP's primal: pmax has no derivative rule)
    amax = whole_max(jax.lax.stop_gradient(jnp.max(jnp.abs(x.astype(jnp.float32)))))
    s = scale_of(amax, dtype)
    return in_format(x.astype(jnp.float32), s, dtype), s


def scale_of(amax, dtype):
    """The scale s of a tensor with absolute maximum `amax` in `dtype`: x ~ x8 * s."""
    return _scale(amax) / _largest(dtype)


def in_format(x, s, dtype):
    """x (float32) / s in `dtype`, saturated at its largest finite value (a cast beyond
    it gives NaN in E4M3, inf in E5M2): only reached where a scale is from less than the
    tensor holds; NaN stays."""
    return jnp.clip(x / s, -_largest(dtype), _largest(dtype)).astype(dtype)


def _transposed(eq: str) -> tuple[str, str]:
    """The einsums of the two cotangents of `a,b->c`: da = `c,b->a`, db = `a,c->b`
    (every index of a and b appears in c or in the other operand: plain matmuls)."""
    inputs, out = eq.replace(" ", "").split("->")
    a, b = inputs.split(",")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


def _dot(eq, a, b):
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


def fp8_einsum(eq: str, x, w, whole_max, w_scale=None, given=None, weight_max=None,
               bits=None):
    """einsum(eq, x, w) on E4M3 operands scaled by their whole-tensor absolute maxima,
    accumulated in float32, returned in x's dtype; its gradient in E5M2 (module
    docstring). `weight_max` reduces w's maximum (default `whole_max`: the tensor
    plan's `weight_max` also over the expert devices a MoE's experts are split over).
    `w_scale`: w arrived quantized (FSDP's FP8 gather, `gather_quantized`):
    its values are E4M3's and this is its scale. `given`: float32 [2], the scales of x
    and of the output gradient from earlier steps (`model.fp8=delayed`,
    framework/model/fp8_delayed.py) in place of their current ones: no maximum, no
    collective before the casts. `bits`: w's E4M3 values as their bits, one byte an
    element (the tick executor's once-a-step copy, `VALUES`), read in place of w,
    which then only takes the gradient. Inside a shard_map both operands are
    first typed as varying over the same mesh axes: the cotangent of one that was
    replicated over an axis (x before a column-parallel matmul) is then summed over it
    by autodiff, as for a plain einsum."""
    maxes = (whole_max, weight_max or whole_max)  # (x's and dy's, w's)
    return checkpoint_name(_scaled(eq, *_alike(x, w, bits), maxes, w_scale, given), PRODUCT)


def _alike(x, w, bits):
    """(x, w, bits) typed as varying over the same mesh axes (`alike`; bits may be None)."""
    return alike(x, w) + (None,) if bits is None else alike(x, w, bits)


@partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def _scaled(eq: str, x, w, bits, maxes, w_scale, given):
    return _forward(eq, x, w, bits, maxes, w_scale, given)[0]


def _forward(eq, x, w, bits, maxes, w_scale, given):
    # (w_scale: w is E4M3's values, or `bits` are; given: x's and dy's scales from the
    # history)
    x8, sx, w8, sw = _operands(x, w, maxes, w_scale, given, bits)
    y = (_dot(eq, x8, w8) * (sx * sw)).astype(x.dtype)
    return y, (x8, sx, _kept_weight(w, w8, w_scale, bits), sw, w_scale, given)


def _kept_weight(w, w8, w_scale, bits):
    """What the backward keeps of the weight (`_e4m3` makes w8 of it again): where it
    arrived quantized, what arrived (w, or its bits): the tick executor recognises a
    layer's own weights among its residuals and does not stash them per microbatch, as
    it would w8, a new array (framework/parallel/pipeline/stash.py); else w8."""
    return w8 if w_scale is None else w if bits is None else bits


def _e4m3(kept):
    """w8 from what `_kept_weight` kept."""
    return from_bits(kept) if kept.dtype == jnp.uint8 else kept.astype(E4M3)


def _fwd(eq, x, w, bits, maxes, w_scale, given):
    return _forward(eq, x, w, bits, maxes, w_scale, given)


def _zeros(*given):
    """The (zero) cotangents of given scales, None where none was given."""
    return tuple(None if g is None else jnp.zeros_like(g) for g in given)


def _gradient(dy, whole_max, given):
    """dy in E5M2 and its scale: the current one, or the history's (`given`)."""
    if given is None:
        return quantize(dy, E5M2, whole_max)
    return in_format(dy.astype(jnp.float32), given[1], E5M2), given[1]


def _bwd(eq, maxes, residuals, dy):
    """The gradients in dy's dtype: the layers cast both operands to the compute dtype
    before their matmuls (framework/model/llama.py), so x, w and y share it. dw is the
    gradient of the weight itself (w8 x its scale), also where w arrived quantized; a
    given scale is a statistic (zero gradient)."""
    x8, sx, w8, sw, w_scale, given = residuals
    dy8, sdy, w8 = *_gradient(dy, maxes[0], given), _e4m3(w8)
    for_x, for_w = _transposed(eq)
    dx = (_dot(for_x, dy8, w8) * (sdy * sw)).astype(dy.dtype)
    dw = (_dot(for_w, x8, dy8) * (sx * sdy)).astype(dy.dtype)
    return (dx, dw, None) + _zeros(w_scale, given)


_scaled.defvjp(_fwd, _bwd)


# --- FP8 collective matmuls (parallel.collective_matmul) --------------------------------
# The tensor-parallel plan's rings (framework/parallel/tensor.py, `gather_ring` and
# `scatter_ring`) with each block's product on E4M3 operands. Each operand is quantized
# once with the whole tensor's scale before its ring, so the same numbers as `fp8_einsum`
# after an all-gather (or before a reduce-scatter) come out, and the blocks that travel
# are E4M3: one byte an element instead of two. The backward runs the other ring:
# gather_matmul's dx is a ring of partial sums of dy8 @ w8^T, matmul_scatter's dx a ring
# that gathers dy8's blocks (E5M2) and multiplies each as it passes; dw = x8^T @ dy8 on
# the whole sequence, from the gathered blocks.

def fp8_gather_matmul(eq: str, x, w, tp, w_scale=None, given=None, bits=None):
    """tp.gather_matmul(eq, x, w) on FP8 operands: x [b, s/tensor, d] -> [b, s, ...]."""
    return checkpoint_name(_gather_mm(eq, tp, *_alike(x, w, bits), w_scale, given), PRODUCT)


def fp8_matmul_scatter(eq: str, x, w, tp, w_scale=None, given=None, bits=None):
    """tp.matmul_scatter(eq, x, w) on FP8 operands: x [b, s, f] -> [b, s/tensor, d]."""
    return checkpoint_name(_scatter_mm(eq, tp, *_alike(x, w, bits), w_scale, given), PRODUCT)


def _operands(x, w, maxes, w_scale, given=None, bits=None):
    """(x8, its scale, w8, its scale); maxes: (x's reduction, w's)."""
    x8, sx = quantize(x, E4M3, maxes[0]) if given is None else \
        (in_format(x.astype(jnp.float32), given[0], E4M3), given[0])
    return (x8, sx) + _weight8(w, maxes[1], w_scale, bits)


def _weight8(w, weight_max, w_scale=None, bits=None):
    """(w8, its scale): quantized here with the whole matrix's scale (its maximum
    reduced by `weight_max`), or as it arrived: w's E4M3 values, or their `bits`, at
    `w_scale`."""
    if w_scale is None:
        return quantize(w, E4M3, weight_max)
    return (w.astype(E4M3) if bits is None else from_bits(bits)), w_scale


def as_bits(w8):
    """E4M3 values as their bits (uint8), one byte an element: an integer array, which
    carries no gradient (JAX's float0 cotangent: no accumulator, no memory)."""
    return jax.lax.bitcast_convert_type(w8, jnp.uint8)


def from_bits(bits):
    """`as_bits`' E4M3 values back."""
    return jax.lax.bitcast_convert_type(bits, E4M3)


def fp8_weight(w, weight_max, w_scale=None, bits=None):
    """w as the FP8 matmuls take it, back in w's dtype: its E4M3 values (quantized here
    with the whole matrix's scale, reduced by `weight_max`, or given so: `w_scale`)
    times the scale (or given as `bits`, `fp8_einsum`'s). For a matmul whose input
    stays in the compute dtype (delayed scaling's filling step,
    framework/model/weight_ops.py); the gradient passes straight through to w, as
    `fp8_einsum`'s dw does."""
    return _fp8_weight(w, weight_max, w_scale, bits)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fp8_weight(w, weight_max, w_scale, bits):
    w8, sw = _weight8(w, weight_max, w_scale, bits)
    return (w8.astype(jnp.float32) * sw).astype(w.dtype)


def _fp8_weight_fwd(w, weight_max, w_scale, bits):
    return _fp8_weight(w, weight_max, w_scale, bits), w_scale


def _fp8_weight_bwd(weight_max, w_scale, g):
    return (g,) + _zeros(w_scale) + (None,)


_fp8_weight.defvjp(_fp8_weight_fwd, _fp8_weight_bwd)


def _scaled_dot(eq, scale, dtype):
    """product(block, w8) for a ring: the float32 product of FP8 operands, scaled, cast."""
    return lambda block, w8: (_dot(eq, block, w8) * scale).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gather_mm(eq, tp, x, w, bits, w_scale, given):
    return _gather_mm_fwd(eq, tp, x, w, bits, w_scale, given)[0]


def _gather_mm_fwd(eq, tp, x, w, bits, w_scale, given):
    x8, sx, w8, sw = _operands(x, w, (tp.whole_max, tp.weight_max), w_scale, given, bits)
    product = _scaled_dot(eq, sx * sw, x.dtype)
    if tp.regather:  # the backward gathers x8's blocks again (`TensorParallel.regather`)
        y, kept = tp.gather_ring(x8, w8, product), x8
    else:  # it reads the blocks this ring passed: x8 gathered, [b, s, d]
        y, kept = tp.gather_ring(x8, w8, lambda block, w8: (product(block, w8), block))
    return y, (kept, sx, _kept_weight(w, w8, w_scale, bits), sw, w_scale, given)


def _gather_mm_bwd(eq, tp, residuals, dy):  # dy [b, s, ...]
    x8, sx, w8, sw, w_scale, given = residuals
    dy8, sdy, w8 = *_gradient(dy, tp.whole_max, given), _e4m3(w8)
    for_x, for_w = _transposed(eq)
    for_dx = _scaled_dot(for_x, sdy * sw, dy.dtype)
    dx, x8 = tp.gather_ring_grads(x8, w8, dy8, for_dx) if tp.regather else (
        tp.scatter_ring(dy8, w8, for_dx), x8)  # (x8 gathered by the forward's ring)
    dw = (_dot(for_w, x8, dy8) * (sx * sdy)).astype(dy.dtype)
    return (dx, dw, None) + _zeros(w_scale, given)


_gather_mm.defvjp(_gather_mm_fwd, _gather_mm_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scatter_mm(eq, tp, x, w, bits, w_scale, given):
    return _scatter_mm_fwd(eq, tp, x, w, bits, w_scale, given)[0]


def _scatter_mm_fwd(eq, tp, x, w, bits, w_scale, given):
    x8, sx, w8, sw = _operands(x, w, (tp.whole_max, tp.weight_max), w_scale, given, bits)
    y = tp.scatter_ring(x8, w8, _scaled_dot(eq, sx * sw, x.dtype))
    return y, (x8, sx, _kept_weight(w, w8, w_scale, bits), sw, w_scale, given)


def _scatter_mm_bwd(eq, tp, residuals, dy):  # dy [b, s/tensor, d]
    x8, sx, w8, sw, w_scale, given = residuals
    # (dy: the whole dy's scale, max over tensor)
    dy8, sdy, w8 = *_gradient(dy, tp.whole_max, given), _e4m3(w8)
    for_x, for_w = _transposed(eq)
    product = _scaled_dot(for_x, sdy * sw, dy.dtype)
    dx, dy8_all = tp.gather_ring(dy8, w8, lambda block, w8: (product(block, w8), block))
    dw = (_dot(for_w, x8, dy8_all) * (sx * sdy)).astype(dy.dtype)
    return (dx, dw, None) + _zeros(w_scale, given)


_scatter_mm.defvjp(_scatter_mm_fwd, _scatter_mm_bwd)


# The layers' matrices whose every use is an FP8 matmul (framework/model/llama.py,
# layers.py: q/k/v, the attention output, gate/up, down).
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down",  # (a MoE's experts' too: the same names)
            "shared_gate_up", "shared_down")  # a MoE's shared experts
STAT_PREFIX = "fp8/"


def is_matrix(path) -> bool:
    """Whether a parameter tree's leaf at `path` is one of the layers' FP8 matrices."""
    return str(getattr(path[-1], "key", "")) in MATRICES


# Non-finite where an FP8 operand is: the run loop refuses the step (framework/run/loop.py).
WATCHED = tuple(f"{STAT_PREFIX}{kind}_amax_max" for kind in ("weight", "activation", "gradient"))


def gathers(model) -> bool:
    """Whether data parallelism's gathers bring the layers' FP8 matrices as E4M3 with
    their scales (`model.fp8_gather`, on by default with `model.fp8`;
    framework/engine/fp8_gathers.py)."""
    return model.fp8 != "none" and model.fp8_gather


# FSDP's FP8 gathers (model.fp8_gather): the Flax collection holding each gathered
# matrix's scale beside its E4M3 values in `params` (read by `weight_op`).
SCALES = "fp8_scales"
# The tick executor's once-a-step copy (framework/engine/step_weights.py) and ZeRO-1's
# once-a-step FP8 gather: the collection holding each quantized matrix's E4M3 values
# as their bits (`as_bits`, one byte an element) beside its scale in SCALES, while
# `params` keeps the matrix (its cast, as stored where FSDP's gathers cast it, or the
# gathered values), which only takes the gradient (`weight_op` hands both to the FP8
# matmul, which reads the bits).
VALUES = "fp8_values"


def params_of(tree):
    """The parameters of a tree `quantized_matrices` made (its gradients' too), or the
    tree itself."""
    return tree["params"] if "params" in tree else tree


def variables(params) -> dict:
    """A layer's Flax variables from what its gather gave: {'params', SCALES} already
    (FSDP's FP8 gathers), or the parameters alone."""
    return params if "params" in params else {"params": params}


def is_matmul(eq: str, w) -> bool:
    """Whether `einsum(eq, x, w)` is a matmul FP8 applies to: a matrix weight with an
    index summed over (a norm's scale and a bias are elementwise)."""
    inputs, out = eq.replace(" ", "").split("->")
    a, b = inputs.split(",")
    return w.ndim >= 2 and "." not in eq and any(i in a and i not in out for i in b)


def check_settings(model) -> list[str]:
    """Problems of `model.fp8` (whatever the platform)."""
    mode = getattr(model, "fp8", "none")
    if mode not in MODES:
        return [f"model.fp8={mode!r} is not one of {', '.join(MODES)}"]
    history = getattr(model, "fp8_history", 1)
    if mode == "delayed" and not (isinstance(history, int) and history >= 1):
        return [f"model.fp8_history={history!r}: the steps a delayed scale is taken from, "
                f"a whole number >= 1"]
    return []


def check_platform(model, platform: str, more_dims: dict | None = None) -> None:
    """A one-line ConfigError where FP8 cannot run on `platform`: TPU v5p has no FP8
    matrix units (its MXUs take bfloat16 and int8), and cuBLASLt's FP8 GEMMs need the
    matrices' dimensions in multiples of GEMM_MULTIPLE. CPUs emulate FP8 (slowly)."""
    from framework.errors import ConfigError

    mode = getattr(model, "fp8", "none")
    if mode == "none":
        return
    if platform == "tpu":
        raise ConfigError(f"model.fp8={mode} needs FP8 matrix units (NVIDIA Hopper or "
                          "later); TPU v5p has none: use model.fp8=none")
    if platform in ("gpu", "cuda"):
        dims = {"model.d_model": model.d_model, "model.d_ff": model.d_ff,
                "model.n_heads * head_dim": model.n_heads * model.head_dim}
        dims.update(more_dims or {})  # (a MoE's experts' widths: framework/engine/validate.py)
        bad = [f"{k}={v}" for k, v in dims.items() if v % GEMM_MULTIPLE]
        if bad:
            raise ConfigError(f"model.fp8={mode} needs matrix dimensions that are "
                              f"multiples of {GEMM_MULTIPLE} (cuBLASLt's FP8 GEMMs): "
                              f"{', '.join(bad)}")
