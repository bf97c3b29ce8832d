"""The stage contract: what a pipeline executor needs from the model, and the few
autodiff tools every executor uses on it. Executors (`autodiff.py`, `ticks.py`) only
execute; the model takes part through `StageFns` alone (it never sees a schedule or a
mesh), and a new executor needs nothing else from it.

  StageFns        embed, a chunk of layers, head + loss, (zero-bubble schedules) the
                  split backward, on one device (tensor-parallel inside), and the weights
                  as their uses make them, once a step (`weights`)
  SplitBackward   the backward of a chunk in two halves, B and W (Qi et al. 2024)
  split_vjp,      a VJP function as (its activations, its structure): the tick executor
  join_vjp        stashes the activations and rebuilds the VJP later; the weights are
                  recognised by identity and never copied
  skip_unless     a layer chunk that runs only where it is real (uneven stages' padding,
                  an idle tick), forward and backward, without saving its weights
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from framework.parallel import vma
from framework.parallel.pipeline.comm import only_on, zeros_typed_like


@dataclass(frozen=True)
class SplitBackward:
    """The backward of a layer chunk in two halves (zero-bubble schedules, Qi et al. 2024):
    `forward(w, x, n_real=None, docs=None, first=None) -> (y, vjp, saved)`, where
    `vjp(dy) -> (dx, dout)` is the B half
    (a `jax.vjp` function of the input and of the weight matmuls' outputs) and `saved`
    the matmul inputs; `weight_grads(w, saved, dout) -> dw` is the W half.

    recompute (under rematerialisation): B and W each pull the incoming gradient through
    the chunk's full VJP, rebuilt from the residuals F stashed (the layer inputs), B
    keeping dx and W the weight gradients; between them only that incoming gradient is
    kept. The matmul inputs and output gradients per layer that the halves above hold
    would be several times the rematerialised stash (`forward` and `weight_grads` are
    then unused)."""

    forward: Callable
    weight_grads: Callable
    recompute: bool = False
    # (w, x, n_real, docs, first, scan) -> y: forward's layers one at a time, each as
    # one(h, (params, taps_l), scanned_l) -> (h', saved_l) run by `scan` (residuals kept
    # in place, `stash.scan_into`)
    layers: Optional[Callable] = None


@dataclass(frozen=True)
class StageFns:
    """What an executor needs from the model, on one device (tensor-parallel inside)."""

    embed: Callable  # (embed params, ids [mb, seq]) -> x [mb, seq (/tensor with SP), d]
    # (chunk params [Lc, ...], x, n_real=None, docs=None, first=None) -> y, like x; first:
    # the global index of the chunk's first layer (Program.first); docs: the
    # microbatch's document masks (`of_microbatch`), which every stage reads; scan=: what
    # runs the loop over the layers (`stash.scan_into`: each layer's residuals into
    # the stash), see `framework.model.stack.apply_layers`
    layers: Callable
    head_loss: Callable  # (head params, embed params, y, targets [mb, seq]) -> loss share
    split: Optional[SplitBackward] = None  # needed by tables with B and W cells
    # (this rank's params) -> (the params the cells compute with, the tree their
    # gradients accumulate like): the layers' matrices as their uses make them (cast,
    # FP8-quantized), once a step (framework/engine/step_weights.py); the tick executor
    # only. None: the params as they are.
    weights: Optional[Callable] = None
    # The compiler keeps a buffer that a conditional passes through in place (XLA's CPU
    # and TPU compilers, and its GPU compiler from jaxlib 0.11.2); the GPU compiler of
    # jaxlib 0.10.2 copies it (`ticks.Cells.apart`, `engine.step.passes_through`).
    pass_through: bool = True
    # The embedding's gradient in two halves where the embedding is a lookup alone (no
    # dense prefix, prefix.py; no per-use gather): (rows(embed, ids, dx) -> the looked-up
    # rows' gradient [mb, seq, d], table(embed, ids, rows) -> the gradient like embed, a
    # scatter-add of the rows), so that a compiler that copies what a conditional passes
    # through runs only the first in one (`lowering.Cells.embed_grad_apart`). None: whole.
    embed_rows: Optional[tuple] = None


def of_microbatch(docs, mb):
    """One microbatch's document masks from all of them (leaves [microbatches, ...]),
    mb traced; None stays None. They are not sent between stages: every rank has the
    microbatches' token ids, from which the step computed them."""
    return None if docs is None else jax.tree.map(lambda a: a[mb], docs)


def split_vjp(vjp_fn, params):
    """VJP pytree -> (leaves that are activations, treedef, which leaves are params)."""
    leaves, treedef = jax.tree.flatten(vjp_fn)
    index = {id(p): i for i, p in enumerate(jax.tree.leaves(params))}
    param_slot = [index.get(id(leaf)) for leaf in leaves]
    acts = [leaf for leaf, slot in zip(leaves, param_slot) if slot is None]
    return acts, treedef, param_slot


def join_vjp(acts, treedef, param_slot, params):
    """The VJP function back from `split_vjp`'s activations and the parameters."""
    flat_params, it = jax.tree.leaves(params), iter(acts)
    return jax.tree.unflatten(treedef, [next(it) if s is None else flat_params[s]
                                        for s in param_slot])


def _cond(scope, pred, work, skip):
    return only_on(scope, pred, work, skip) if scope else jax.lax.cond(pred, work, skip)


def skip_unless(real, fn, weights, x, *extra, has_aux: bool = False, scope=None):
    """fn(weights, x, *extra) -> y (or (y, aux)) where `real` (a traced bool); where
    not, x itself (and zeros like aux), forward and backward: zero weight gradients,
    dx = dy. What is skipped skips its tensor-parallel collectives too (all devices of
    a `tensor` group share the pipeline rank, so they take the same branch).

    A plain `lax.cond` would do, except that its autodiff saves the weights it reads
    as a per-iteration residual of the loop around it (the tick loop, a layer scan).
    Here the backward gets the weights as the forward's own input, which the loop's
    autodiff does not copy, and only the activations are saved. `extra` (uneven
    stages' layer count) are arguments: a custom VJP may not close over traced values.
    `scope`: the named scope of the work (the communication audit weighs it)."""
    # a residual: typed like the activations beside it (the tick stash)
    real = vma.cast(real, vma.varying(x))
    bound = lambda extra: lambda w, x: fn(w, x, *extra)
    probe = jax.vjp(bound(extra), weights, x, has_aux=has_aux)  # types only (dead code)
    acts_like, treedef, slots = split_vjp(probe[1], weights)
    aux_like = probe[2] if has_aux else None
    skipped = lambda x: (x, jax.tree.map(zeros_typed_like, aux_like)) if has_aux else x

    def fwd(weights, x, real, extra):  # -> (output, what the backward needs)
        def work():
            out = jax.vjp(bound(extra), weights, x, has_aux=has_aux)
            return out[0], split_vjp(out[1], weights)[0], out[2] if has_aux else None
        skip = lambda: (x, [zeros_typed_like(a) for a in acts_like],
                        jax.tree.map(zeros_typed_like, aux_like))
        y, acts, aux = _cond(scope, real, work, skip)
        return (y, aux) if has_aux else y, (weights, acts, real)

    def bwd(saved, d_out):  # (an integer weight's cotangent: None in both branches)
        weights, acts, real = saved
        dy = d_out[0] if has_aux else d_out
        work = lambda: no_float0(join_vjp(acts, treedef, slots, weights)(dy))
        skip = lambda: (jax.tree.map(zeros_typed_like, differentiable(weights)), dy)
        return (*_cond(scope, real, work, skip), None, None)

    run = jax.custom_vjp(lambda w, x, r, e: _cond(scope, r, lambda: bound(e)(w, x),
                                                  lambda: skipped(x)))
    run.defvjp(fwd, bwd)
    return run(weights, x, real, extra)


def no_float0(tree):
    """`tree` with None for its float0 leaves (an integer's cotangent: no gradient), as
    every cotangent the executors hand on or add is (`differentiable`)."""
    return jax.tree.map(lambda a: None if a.dtype == jax.dtypes.float0 else a, tree)


def differentiable(tree):
    """`tree` with None for its integer leaves (the once-a-step copy's FP8 bits,
    framework/engine/step_weights.py): the structure of its cotangents."""
    return jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact) else None, tree)
