"""The zero-bubble split backward (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"):
the backward of a stack of layers in two halves that a schedule can run at different
ticks. B, the gradient w.r.t. the input, and W, the gradient w.r.t. the weights, which
needs only each weight op's input x (saved by the forward) and its output gradient dy
(taken by B): dW = x^T dy, one matmul per weight.

The model takes part through one hook: every use of a layer weight goes through
`weight_op` (framework/model/llama.py), which under the collections used here records
its input, adds a zero "tap" whose gradient is dL/dy, or replays the op on a given
input. Everything else in a layer is dead code for W, which XLA drops.
"""

from __future__ import annotations

from functools import lru_cache

import jax

from framework.errors import PlanError
from framework.model import fp8
from framework.model.registry import spec_of
from framework.config import ModelConfig
from framework.parallel.pipeline.stage import SplitBackward
from framework.parallel.tensor import TensorParallel


def split_layers(cfg: ModelConfig, remat: str = "none", recompute: bool | None = None,
                 tp: TensorParallel = TensorParallel(), skip=None, gather=None):
    """The backward of a stack of layers in two halves, B and W (module docstring).

    forward(layers, x, n_real=None, docs=None, first=None) -> (y, vjp, saved): vjp(dy) ->
    (dx, douts) runs B (the VJP of the input and of the zero taps on every weight op's
    output; the weights are constants to it); saved: the weight ops' inputs [L, ...].
    `n_real`: the layers after the first n_real are padding (uneven stages), passed over
    by `skip`; `first`: the global index of the first layer (`apply_layers`'s).
    weight_grads(layers, saved, douts) -> grads like layers runs W: the weight ops on
    their saved inputs, pulled back through their output gradients. `remat`, `gather`:
    as `apply_layers`'s (`Layout.layer_remat`; FSDP's gather). `recompute`: whether the
    stash keeps only layer inputs (`Remat.keeps_inputs_only`; default: under any remat).
    layers(layers, x, ..., scan=...) -> y: forward's layers as one(h, (params, taps_l),
    scanned_l) -> (h', saved_l) run by `scan` (each layer's VJP kept in place by the tick
    executor, `stash.scan_into`)."""
    identity = lambda params: params
    gather, spec = identity if gather is None else gather, spec_of(cfg)
    ops = spec.weight_ops
    SAVED, TAPS = ops.saved, ops.taps  # noqa: N806 (the model's collection names)

    def block(variables, x, mutable, docs=None, window=None):
        return ops.block(cfg, tp).apply(variables, x, mutable=mutable, docs=docs, window=window)

    def layer(x, params, taps, docs, window):  # one layer, recording its weight ops' inputs
        y, state = block({**fp8.variables(params), TAPS: taps}, x, [SAVED], docs, window)
        return y, state[SAVED]
    layer = spec.checkpointed(layer, remat, None if gather is identity else gather)

    def prepare(layers, x, first):  # (zero taps [L, ...] like each weight op's output
        # (traced: dead code), the windows, a layer of (x, (params, taps), docs, window))
        taps = jax.vmap(lambda p: block(fp8.variables(gather(p)), x, [TAPS])[1][TAPS])(layers)
        fixed, windows = ops.split_windows(ops.layer_windows(cfg, jax.tree.leaves(layers)[0].shape[0],
                                                     first), x)
        scanned = lambda x, params_and_taps, docs, window: layer(
            x, *params_and_taps, docs, fixed if window is None else window)
        return taps, windows, scanned

    def forward(layers, x, n_real=None, docs=None, first=None):
        taps, windows, scanned = prepare(layers, x, first)
        run = lambda x, taps: ops.scan_layers(scanned, x, (layers, taps), n_real, skip,
                                          has_aux=True, extra=(docs,), windows=windows)
        return jax.vjp(run, x, taps, has_aux=True)

    def layers_by(layers, x, n_real=None, docs=None, first=None, scan=None):
        taps, windows, scanned = prepare(layers, x, first)
        one, per_layer = ops.one_layer(scanned, jax.tree.leaves(layers)[0].shape[0], n_real,
                                       skip, has_aux=True, extra=(docs,), windows=windows)
        return scan(one, x, (layers, taps), per_layer)

    def weight_grads(layers, saved, douts):
        products = lambda layers: jax.vmap(
            lambda p, s: ops.replay(cfg, tp, gather(p), s))(layers, saved)
        return jax.vjp(products, layers)[1](douts)[0]

    # Under remat the stash holds only layer inputs: B and W recompute from it
    # (SplitBackward.recompute) rather than keep each weight op's input and dy.
    recompute = remat != "none" if recompute is None else recompute
    return SplitBackward(forward, weight_grads, recompute=recompute, layers=layers_by)


@lru_cache(maxsize=None)
def check_weight_ops(cfg: ModelConfig) -> None:
    """Raises PlanError if a layer weight bypasses `weight_op`: the W half would give it
    a zero gradient without any error (called when an engine with a zero-bubble
    schedule is built)."""
    missing = spec_of(cfg).weight_ops.outside(cfg)
    if missing:
        raise PlanError(f"layer weights {', '.join(missing)} are used without weight_op "
                        f"(framework/model/llama.py): a zero-bubble schedule (zb_h1, zb_v) "
                        f"would give them a zero gradient; route every use through "
                        f"weight_op or pick another parallel.schedule")
