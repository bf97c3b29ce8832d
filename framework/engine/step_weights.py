"""The layers' weights as their uses make them, made once a step: the tick executor's
compute copy (`StageFns.weights`, framework/parallel/pipeline/ticks.py).

Every use of a layer matrix casts it to the compute dtype (`model.dtype`) first, and
with `model.fp8` quantizes it to E4M3 with the whole matrix's scale (`fp8.quantize`).
In a pipeline those uses repeat: each microbatch's forward, its recomputation under
remat, its backward, all from the stored float32 weights. Here the rank's matrices are
cast once before the tick loop, and with FP8 each layer's FP8 matrices (`fp8.MATRICES`)
quantized once too (a scale per layer), their E4M3 values held as their bits, one byte
an element (`fp8.VALUES`, uint8: an integer takes no gradient, so no accumulator); the
matrix's cast beside them only takes the gradient, in the compute dtype as every use's
(the uses read the bits and the scale, `weight_ops._arrived`, so the compiler drops the
cast; the backward keeps the bits, which the executor recognises as the layer's own
weights and does not stash per microbatch). TransformerEngine caches FP8 weights
across microbatches the same way (its `is_first_microbatch`).

The numbers do not change: the cast, the amax and the quantization are what each use
computed, and the gradients, taken with respect to the copy, are the same values (the
use's cast passed a bfloat16 cotangent through to float32), added into accumulators in
the stored dtype (`like`; tests/parity/test_step_weights.py: bitwise). One rounding
apart where XLA had dropped a float32 -> bfloat16 -> float32 round trip of a weight
gradient under the per-use cast (its excess precision): the experts' `ragged_dot`.
The cost is memory: the copy, two bytes an element of the rank's matrices (one for the
FP8 matrices), held through the loop (framework/analysis/memory_model.py); under
`parallel.remat=none` a stash slot no longer keeps its own cast of each matrix.

Where the uses gather their weights (FSDP per use: each gather casts or quantizes its
layer, framework/engine/step.py) only the FP8 matrices FSDP leaves whole are made here
(a MoE's experts split over `expert` as many ways as `data`): each use had quantized
them from the stored float32, and the GPU compiler had carried them into the tick loop
in float32 in the layouts the FP8 GEMMs read (docs/performance.md: qwen3_30b_a3b's
FP8 memory, 2026-12-01).
Not used by the autodiff executor (GPipe, circular), whose autodiff would sum a
loop-invariant copy's cotangents in the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from framework.config import ModelConfig
from framework.engine.fp8_gathers import quantize_layers, quantized_matrices
from framework.model import fp8
from framework.parallel import data as data_parallel
from framework.parallel.pipeline.stage import differentiable

STACKED = 2  # a rank's chunks [v, Lc, ...]: the dimensions before one use's


def _cast(dtype, stacked: int):
    """A leaf as its uses cast it: the matrices in `dtype` where it is narrower than
    theirs (`data_parallel.narrowed`); the rest (norm scales, probes, FP8 scales) as
    they are."""
    return lambda a: a.astype(dtype) if data_parallel.narrowed(a, stacked, dtype) else a


def _quantized(chunks, model: ModelConfig, whole_max, which=None):
    """The chunks' Flax variables with each FP8 matrix quantized, a scale per layer:
    {'params' as stored, SCALES: the scales, VALUES: the E4M3 values as their bits
    (`fp8.as_bits`), nested as the matrices are}; the chunks as they are without FP8,
    or where the step's gather quantized them already (ZeRO-1's FP8 gathers:
    {'params': the values, SCALES, VALUES}). `which`: the key paths
    (`jax.tree_util.keystr`) of the matrices to quantize (default: every one)."""
    if model.fp8 == "none" or fp8.SCALES in chunks:
        return chunks
    variables, dtype = fp8.variables(chunks), jnp.dtype(model.dtype)

    def quantize(w, _):  # (w as it is, the scales [v, Lc], the E4M3 values' bits)
        w8, s = quantize_layers(w, dtype, whole_max, STACKED)
        return w, s, fp8.as_bits(w8)

    picked = jax.tree_util.tree_map_with_path(  # 0: no dimension gathered; None: as is
        lambda path, _: 0 if which is None or jax.tree_util.keystr(path) in which else None,
        variables["params"])
    return {**variables, **quantized_matrices(variables["params"], picked, quantize)}


def _whole_matrices(dims) -> frozenset:
    """FSDP per use: the key paths of the FP8 matrices FSDP does not split (`dims`, its
    dimension per stored leaf: None there)."""
    found = jax.tree_util.tree_leaves_with_path(dims, is_leaf=lambda d: d is None)
    return frozenset(jax.tree_util.keystr(path) for path, d in found
                     if d is None and fp8.is_matrix(path))


def copy_bytes(compute, stored) -> tuple[int, int]:
    """(the bytes the copy holds, the same in the compute dtype): the leaves of
    `compute` (what `once_a_step` made) that are not the stored ones (`stored`), but
    for the matrices whose E4M3 values it holds as bits (VALUES), whose compute-dtype
    leaf only takes the gradient (the uses read the bits: the compiler drops the cast;
    their gradient is in the compute dtype, as every matrix's, which a cell's layer scan
    stacks in two bytes an element, not four). The second is what the cells' uses
    would have cast (framework/analysis/memory_model.py `_tick_kept`): the bits and
    scales left out, the casts in."""
    ids, chunks = {id(a) for a in jax.tree.leaves(stored)}, compute["chunks"]
    carriers, bits = set(), set()
    if fp8.VALUES in chunks:
        held = {jax.tree_util.keystr(path)
                for path, _ in jax.tree_util.tree_leaves_with_path(chunks[fp8.VALUES])}
        carriers = {id(a) for path, a in jax.tree_util.tree_leaves_with_path(chunks["params"])
                    if jax.tree_util.keystr(path) in held}
        bits = {id(a) for a in jax.tree.leaves((chunks[fp8.VALUES], chunks[fp8.SCALES]))}
    size = lambda ok: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(compute)
                          if id(a) not in ids and ok(id(a)))
    return size(lambda i: i not in carriers), size(lambda i: i not in bits)


def _accumulators(chunks, stored):
    """What the chunks' gradients accumulate like: the stored leaves, and where the
    matrices were quantized here, the scales beside them (their zero gradients are
    dropped by the step's reduction, `fp8.params_of`); no accumulator for the values'
    bits, made here or by ZeRO-1's FP8 gathers (None: `stage.differentiable`; their
    float0 cotangents the executor drops)."""
    if chunks is not stored:
        stored = {**fp8.variables(stored), fp8.SCALES: chunks[fp8.SCALES],
                  fp8.VALUES: chunks[fp8.VALUES]}
    return differentiable(stored)


def once_a_step(model: ModelConfig, whole_max, per_use=None):
    """params {'embed', 'head', 'chunks' [v, Lc, ...]} -> (the params the cells compute
    with, the tree their gradients accumulate like). `per_use`: FSDP's dimension per
    stored leaf where the uses gather their weights: then only the FP8 matrices it
    leaves whole are quantized here (the rest as stored), and None is returned where
    there are none (or no FP8). The embedding stays as stored (a lookup's gradient
    scatter-adds rows: summed in the stored dtype)."""
    if per_use is not None:
        whole = frozenset() if model.fp8 == "none" else _whole_matrices(per_use["stages"])
        return _quantized_only(model, whole_max, whole) if whole else None
    dtype = jnp.dtype(model.dtype)

    def run(params):
        chunks = _quantized(params["chunks"], model, whole_max)
        like = dict(params, chunks=_accumulators(chunks, params["chunks"]))
        compute = dict(params, head=jax.tree.map(_cast(dtype, 0), params["head"]),
                       chunks=jax.tree.map(_cast(dtype, STACKED), chunks))
        return compute, like

    return run


def _quantized_only(model: ModelConfig, whole_max, whole: frozenset):
    """FSDP per use: the chunks' FP8 matrices at the key paths `whole` quantized once a
    step (`_quantized`), everything else (a MoE layer's statistics probe too) as stored
    for the uses' gathers."""
    def run(params):
        chunks = _quantized(params["chunks"], model, whole_max, whole)
        return (dict(params, chunks=chunks),
                dict(params, chunks=_accumulators(chunks, params["chunks"])))

    return run
