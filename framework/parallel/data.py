"""Data parallelism: the batch is split over `data` (by the engine's shard_map) and
gradients are reduced over `data` exactly once per optimizer step, here.

Without ZeRO every data replica holds all parameters and optimizer state, and the
per-replica gradient sums are all-reduced (`psum`). With ZeRO-1 (Rajbhandari et al.
2020) parameters and optimizer state are stored sharded over `data` along one
dimension per leaf: the step all-gathers the parameters, reduce-scatters the
gradients and each replica updates only its own shard (with fp32 parameters the
stored parameters are the master copy, so it is sharded too).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from framework.parallel.mesh import DATA


def zero1_dims(shapes, specs, data: int):
    """Per leaf: the dimension to shard over `data` (the largest dim not already
    sharded whose size divides evenly), or None to leave the leaf replicated."""

    def pick(shape, spec):
        spec = tuple(spec) + (None,) * (len(shape) - len(spec))
        free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % data == 0]
        return max(free, key=lambda d: shape[d]) if free else None

    return jax.tree.map(lambda s, sp: pick(s.shape, sp), shapes, specs,
                        is_leaf=lambda x: isinstance(x, P))


def add_data_axis(specs, dims):
    """PartitionSpecs with `data` placed on each leaf's ZeRO-1 dimension."""

    def one(spec, dim):
        if dim is None:
            return spec
        parts = list(spec) + [None] * (dim + 1 - len(spec))
        parts[dim] = DATA
        return P(*parts)

    return jax.tree.map(one, specs, dims, is_leaf=lambda x: isinstance(x, P) or x is None)


def gather_params(params, dims):
    """ZeRO-1: the full parameters for this step from this replica's shards."""
    return jax.tree.map(
        lambda x, d: x if d is None else jax.lax.all_gather(x, DATA, axis=d, tiled=True),
        params, dims, is_leaf=lambda x: x is None)


def reduce_gradients(grads, dims=None):
    """The one reduction of the gradients over `data` per step: all-reduce every leaf,
    or with ZeRO-1 (`dims`) reduce-scatter each leaf onto its shard."""
    if dims is None:
        return jax.lax.psum(grads, DATA)
    return jax.tree.map(
        lambda g, d: jax.lax.psum(g, DATA) if d is None
        else jax.lax.psum_scatter(g, DATA, scatter_dimension=d, tiled=True),
        grads, dims, is_leaf=lambda x: x is None)
