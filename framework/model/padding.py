"""Padding layers: a stack of `n` layers of which only the first `n_real` are real.

Uneven pipeline stages (`parallel.stage_layers`) give every chunk of layers the length
of the longest one, so the stage layout stays one array per weight; a chunk with fewer
real layers carries zero weights at its end. `skip_unless` runs a layer where it is
real and passes its input through where it is padding, in the forward and in the
backward (the padding's weight gradients are zeros), so a short stage does a short
stage's work.

A plain `lax.cond` inside the layer scan would do the same, except that its autodiff
keeps each layer's weights as a per-layer residual (a copy of the chunk's weights per
microbatch in flight). Here the backward gets the weights as the forward's own input,
which the scan's autodiff does not copy, and only the activations are residuals.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _zeros_typed(a):
    """Zeros like `a`, varying over the same manual mesh axes (so both branches of a
    cond have one type inside a `shard_map`; outside one there are none)."""
    z = jnp.zeros(a.shape, a.dtype)
    axes = tuple(sorted(jax.typeof(a).manual_axis_type.varying))
    return jax.lax.pcast(z, axes, to="varying") if axes else z


def _flatten_vjp(vjp_fn, weights):
    """A VJP function -> (its leaves that are not the weights, rebuild(acts, weights))."""
    leaves, treedef = jax.tree.flatten(vjp_fn)
    index = {id(w): i for i, w in enumerate(jax.tree.leaves(weights))}
    slot = [index.get(id(leaf)) for leaf in leaves]
    acts = [leaf for leaf, s in zip(leaves, slot) if s is None]

    def rebuild(acts, weights):
        flat, it = jax.tree.leaves(weights), iter(acts)
        return jax.tree.unflatten(treedef, [next(it) if s is None else flat[s] for s in slot])

    return acts, rebuild


def skip_unless(real, fn, weights, x, has_aux: bool = False):
    """fn(weights, x) -> y (or (y, aux)) where `real` (a traced bool); where not, x
    itself (and zeros like aux), with zero weight gradients and dx = dy."""
    missing = set(jax.typeof(x).manual_axis_type.varying) - set(
        jax.typeof(real).manual_axis_type.varying)
    if missing:  # a residual: typed like the activations beside it
        real = jax.lax.pcast(real, tuple(sorted(missing)), to="varying")
    probe = jax.vjp(fn, weights, x, has_aux=has_aux)  # types only (dead code)
    acts_like, rebuild = _flatten_vjp(probe[1], weights)
    aux_like = probe[2] if has_aux else None

    def work(weights, x):
        out = jax.vjp(fn, weights, x, has_aux=has_aux)
        return out[0], _flatten_vjp(out[1], weights)[0], out[2] if has_aux else None

    def skip(weights, x):
        return x, [_zeros_typed(a) for a in acts_like], jax.tree.map(_zeros_typed, aux_like)

    def fwd(weights, x, real):
        y, acts, aux = jax.lax.cond(real, work, skip, weights, x)
        return (y, aux) if has_aux else y, (weights, acts, real)

    def bwd(saved, d_out):
        weights, acts, real = saved
        dy = d_out[0] if has_aux else d_out
        grads = lambda: rebuild(acts, weights)(dy)
        nothing = lambda: (jax.tree.map(_zeros_typed, weights), dy)
        return (*jax.lax.cond(real, grads, nothing), None)

    run = jax.custom_vjp(lambda weights, x, real: fwd(weights, x, real)[0])
    run.defvjp(fwd, bwd)
    return run(weights, x, real)
