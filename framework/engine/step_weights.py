"""The layers' weights as their uses make them, made once a step: the tick executor's
compute copy (`StageFns.weights`, framework/parallel/pipeline/ticks.py).

Every use of a layer matrix casts it to the compute dtype (`model.dtype`) first, and
with `model.fp8` quantizes it to E4M3 with the whole matrix's scale (`fp8.quantize`).
In a pipeline those uses repeat: each microbatch's forward, its recomputation under
remat, its backward, all from the stored float32 weights. Here the rank's matrices are
cast once before the tick loop, and with FP8 each layer's FP8 matrices (`fp8.MATRICES`)
quantized once too (a scale per layer: the E4M3 values kept in the compute dtype, which
holds them exactly; the uses then read the scale given beside them, as after FSDP's
FP8 gathers, framework/engine/fp8_gathers.py). TransformerEngine caches FP8 weights
across microbatches the same way (its `is_first_microbatch`).

The numbers do not change: the cast, the amax and the quantization are what each use
computed, and the gradients, taken with respect to the copy, are the same values (the
use's cast passed a bfloat16 cotangent through to float32), added into accumulators in
the stored dtype (`like`; tests/parity/test_step_weights.py: bitwise). One rounding
apart where XLA had dropped a float32 -> bfloat16 -> float32 round trip of a weight
gradient under the per-use cast (its excess precision): the experts' `ragged_dot`.
The cost is memory: the copy, two bytes an element of the rank's matrices, held
through the loop (framework/analysis/memory_model.py); under `parallel.remat=none` a
stash slot no longer keeps its own cast of each matrix.

Not made where the uses gather their weights (FSDP per use: each gather casts or
quantizes its layer, framework/engine/step.py), and not used by the autodiff executor
(GPipe, circular), whose autodiff would sum a loop-invariant copy's cotangents in the
compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from framework.config import ModelConfig
from framework.engine.fp8_gathers import quantize_layers, quantized_matrices
from framework.model import fp8
from framework.parallel import data as data_parallel

STACKED = 2  # a rank's chunks [v, Lc, ...]: the dimensions before one use's


def _cast(dtype, stacked: int):
    """A leaf as its uses cast it: the matrices in `dtype` where it is narrower than
    theirs (`data_parallel.narrowed`); the rest (norm scales, probes, FP8 scales) as
    they are."""
    return lambda a: a.astype(dtype) if data_parallel.narrowed(a, stacked, dtype) else a


def _quantized(chunks, model: ModelConfig, whole_max):
    """The chunks' Flax variables with each FP8 matrix quantized, a scale per layer
    ({'params', SCALES, ...} as FSDP's FP8 gathers make them; the E4M3 values in the
    compute dtype); the chunks as they are without FP8, or where the step's gather
    quantized them already (ZeRO-1's FP8 gathers)."""
    if model.fp8 == "none" or fp8.SCALES in chunks:
        return chunks
    variables, dtype = fp8.variables(chunks), jnp.dtype(model.dtype)

    def quantize(w, _):  # (the E4M3 values in the compute dtype, the scales [v, Lc])
        w8, s = quantize_layers(w, dtype, whole_max, STACKED)
        return w8.astype(dtype), s

    every = jax.tree.map(lambda _: 0, variables["params"])  # (no dimension gathered)
    return {**variables, **quantized_matrices(variables["params"], every, quantize)}


def _accumulators(chunks, stored):
    """What the chunks' gradients accumulate like: the stored leaves, and where the
    matrices were quantized here ({'params', SCALES}), the scales beside them (their
    zero gradients are dropped by the step's reduction, `fp8.params_of`)."""
    if chunks is stored or fp8.SCALES in stored:
        return stored
    return {**fp8.variables(stored), fp8.SCALES: chunks[fp8.SCALES]}


def once_a_step(model: ModelConfig, whole_max, per_use: bool):
    """params {'embed', 'head', 'chunks' [v, Lc, ...]} -> (the params the cells compute
    with, the tree their gradients accumulate like); None where the uses gather their
    weights (FSDP per use). The embedding stays as stored (a lookup's gradient
    scatter-adds rows: summed in the stored dtype)."""
    if per_use:
        return None
    dtype = jnp.dtype(model.dtype)

    def run(params):
        chunks = _quantized(params["chunks"], model, whole_max)
        like = dict(params, chunks=_accumulators(chunks, params["chunks"]))
        compute = dict(params, head=jax.tree.map(_cast(dtype, 0), params["head"]),
                       chunks=jax.tree.map(_cast(dtype, STACKED), chunks))
        return compute, like

    return run
