"""FP8 weight gathers (`model.fp8_gather`, on by default with `model.fp8`): where data
parallelism gathers the layers' weights (FSDP per use, ZeRO-1 and FSDP once a step:
framework/parallel/data.py), their FP8 matrices (`fp8.MATRICES`) travel as E4M3, one
byte an element, with their scales, instead of in the compute or stored dtype.

Each shard is quantized with the whole matrix's scale (the shards' absolute maxima's
max over the axes the matrix is split over), so the gathered values are exactly what
the matmul's own quantization of the gathered matrix gives (`fp8.quantize`): the layer
gets {'params': values, fp8.SCALES: scales} as its Flax variables and its `weight_op`
takes the given scale instead of measuring one. The once-a-step gather adds the
values' bits (fp8.VALUES: one byte an element, held through the step), which the uses
read instead of the values. The gradients flow to the values as the
weights' own (straight through the quantization, as in `fp8.fp8_einsum`) and are
reduce-scattered in the stored dtype as without FP8.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from framework.model import fp8
from framework.parallel import data as data_parallel


def quantize_layers(w, dtype, whole_max, stacked: int, axes=None):
    """Each matrix of w (the dimensions after the first `stacked`) as its use quantizes
    it: cast to `dtype` (the use's cast), then to E4M3 with the whole matrix's scale
    (its absolute maximum's max over the mesh `axes` where a shard of it is all w
    holds, then `whole_max`'s over the tensor devices). Returns (the E4M3 values, the
    scales [*stacked dims]): exactly `fp8.quantize` of each matrix."""
    shard = w.astype(dtype).astype(jnp.float32)  # the use's cast, then quantize's
    inner = tuple(range(stacked, w.ndim))
    # a statistic, never differentiated
    amax = jax.lax.stop_gradient(jnp.max(jnp.abs(shard), axis=inner))  # [*stacked dims]
    if axes is not None:
        amax = jax.lax.pmax(amax, axes)
    s = fp8.scale_of(whole_max(amax), fp8.E4M3)
    return fp8.in_format(shard, s.reshape(s.shape + (1,) * len(inner)), fp8.E4M3), s


def _quantize_gather(w, dim: int, axes, dtype, whole_max, stacked: int):
    """The one body of both gathers: w's shard quantized (`quantize_layers`; the
    maxima over `axes` where `dim` splits the matrices, else each device holds whole
    matrices and their scales travel with them), gathered over `axes` along `dim` in
    one byte an element. Returns (the E4M3 values, the scales [*stacked dims]).
    Exactly `fp8.quantize` of each gathered matrix: max and the elementwise scaling
    commute with the gather."""
    w8, s = quantize_layers(w, dtype, whole_max, stacked, axes if dim >= stacked else None)
    values = jax.lax.all_gather(w8, axes, axis=dim, tiled=True)
    if dim < stacked:
        s = jax.lax.all_gather(s, axes, axis=dim, tiled=True)
    return values, s


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def gather_quantized(w, axis_name: str, axis: int, dtype, whole_max):
    """FSDP's gather of one matrix as FP8 (per use): (the whole matrix's E4M3 values in
    `dtype`, its scale), gathered over `axis_name` along `axis` (`_quantize_gather`
    with no stacking dimensions). The transpose reduce-scatters the gradient in w's
    dtype, as FSDP's plain gather (framework/parallel/data.py)."""
    return _gather_quantized_fwd(w, axis_name, axis, dtype, whole_max)[0]


def _gather_quantized_fwd(w, axis_name, axis, dtype, whole_max):
    values, s = _quantize_gather(w, axis, axis_name, dtype, whole_max, 0)
    return (values.astype(dtype), s), jnp.zeros((), w.dtype)


def _gather_quantized_bwd(axis_name, axis, dtype, whole_max, home, grads):
    return (jax.lax.psum_scatter(grads[0].astype(home.dtype), axis_name,
                                 scatter_dimension=axis, tiled=True),)


gather_quantized.defvjp(_gather_quantized_fwd, _gather_quantized_bwd)


def gather_layers_quantized(w, dim: int, axes, dtype, whole_max, stacked: int = 3):
    """ZeRO-1's once-a-step gather (and FSDP's with `fsdp_regather=step`) of one stacked
    matrix w [stage, chunk, layer, ...] as FP8: each layer's matrix with its own scale
    (`_quantize_gather`). Returns (the E4M3 values in w's dtype, the scales [stage,
    chunk, layer], the values' bits: `fp8.as_bits`, one byte an element). The uses read
    the bits and the scale (`weight_ops._arrived`), so the compiler drops the values,
    which only take the gradient (the step's, with respect to them, as the weights';
    nothing here is differentiated): the step holds one byte an element of the stage's
    FP8 matrices, not the compute dtype's two."""
    values, s = _quantize_gather(w, dim, axes, dtype, whole_max, stacked)
    return values.astype(w.dtype), s, fp8.as_bits(values)


def quantized_matrices(params, dims, gather):
    """`params` with each of the layers' FP8 matrices (`fp8.MATRICES`) that `dims` shards
    (not None) replaced by gather(w, dim) -> (values, scale) or (values, scale, bits):
    {'params': the tree, fp8.SCALES: the scales, and where the gather gave them,
    fp8.VALUES: the bits, nested as the matrices are} (a layer's Flax variables, or a
    stack of them)."""
    scales, bits = {}, {}

    def one(path, w, d):
        if not fp8.is_matrix(path) or d is None:
            return w
        value, scale, *rest = gather(w, d)
        _put(scales, path, scale)
        if rest:
            _put(bits, path, rest[0])
        return value

    params = jax.tree_util.tree_map_with_path(one, params, dims)
    return {"params": params, fp8.SCALES: scales, **({fp8.VALUES: bits} if bits else {})}


def _put(tree: dict, path, leaf) -> None:
    """tree[k0][k1]... = leaf along a key path, making the dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key.key, {})
    tree[path[-1].key] = leaf


def unquantized(dims):
    """`dims` with the FP8 matrices' left out (None): what the plain gathers take."""
    return jax.tree_util.tree_map_with_path(
        lambda path, d: None if fp8.is_matrix(path) else d, dims, is_leaf=lambda d: d is None)


def layer_gather(dims, model, whole_max):
    """FSDP's gather of one layer (per use), its FP8 matrices as E4M3 with their scales
    (`gather_quantized`), the rest as `data_parallel.gather_leaves` in the compute
    dtype: {'params', SCALES}, the layer's variables. `dims`: FSDP's dimension per
    stored leaf. None without FP8, FSDP per use or with model.fp8_gather=false."""
    if dims is None or not fp8.gathers(model):
        return None
    dtype, rest = jnp.dtype(model.dtype), unquantized(dims["stages"])
    quantized = lambda w, d: gather_quantized(w, data_parallel.shard_axes(d), d - 3, dtype,
                                              whole_max)
    return lambda params: quantized_matrices(
        data_parallel.gather_leaves(params, rest, offset=3, dtype=dtype), dims["stages"],
        quantized)


def step_gather(zero1_dims, model, whole_max):
    """ZeRO-1's gather of the step's parameters (FSDP's with fsdp_regather=step): with
    FP8 gathers the layers' FP8 matrices as E4M3 with a scale per layer
    (`gather_layers_quantized`), the stages then {'params', SCALES, VALUES} (each
    layer's variables once sliced); the other matrices in the compute dtype, the rest
    as stored (`data_parallel.gather_params`)."""
    dtype = jnp.dtype(model.dtype)
    plain = partial(data_parallel.gather_params, dims=zero1_dims, dtype=dtype)
    if not fp8.gathers(model):
        return plain
    dims = zero1_dims["stages"]
    quantized = lambda w, d: gather_layers_quantized(w, d, data_parallel.shard_axes(d),
                                                     dtype, whole_max)

    def gather(params):
        params = plain(params, dims=dict(zero1_dims, stages=unquantized(dims)))
        return dict(params, stages=quantized_matrices(params["stages"], dims, quantized))

    return gather


def on_params(gather):
    """A layer's gather that takes the layer's Flax variables ({'params', and the train
    step's FP8 probes: framework/engine/fp8_probe.py, and the scales of the matrices
    quantized once a step: framework/engine/step_weights.py}) or its params alone, and
    gathers the params; the scales the gather gives join those the layer had."""
    if gather is None:
        return None

    def run(tree):
        if "params" not in tree:
            return gather(tree)
        got = fp8.variables(gather(tree["params"]))
        if fp8.SCALES in tree and fp8.SCALES in got:
            got = dict(got, **{fp8.SCALES: _merged(tree[fp8.SCALES], got[fp8.SCALES])})
        return {**tree, **got}

    return run


def _merged(a: dict, b: dict) -> dict:
    """Two nested dicts of scales, each matrix's in one of them, as one."""
    out = dict(a)
    for key, value in b.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and key in out \
            else value
    return out
