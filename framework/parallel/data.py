"""Data parallelism: the batch is split over `data` (by the engine's shard_map) and
gradients are reduced over `data` exactly once per optimizer step, here.

Without ZeRO every data replica holds all parameters and optimizer state, and the
per-replica gradient sums are all-reduced (`psum`). With ZeRO-1 (Rajbhandari et al.
2020) parameters and optimizer state are stored sharded over `data` along one
dimension per leaf: the step all-gathers the parameters, reduce-scatters the
gradients and each replica updates only its own shard (with fp32 parameters the
stored parameters are the master copy, so it is sharded too).

With FSDP (ZeRO-3, `parallel.fsdp`) the parameters stay sharded through the step: each
use gathers them (`gather_leaves`, called per layer inside the layer's function and
per use of the embedding and the head, so a layer's full weights live only while it
runs, and are gathered again for its backward), and autodiff turns each gather into
a reduce-scatter of that use's gradient: the gradients come out of the pipeline
already summed over `data` and sharded like the parameters. Each microbatch gathers
again (m x the bytes of one gather per step, the least memory); with
`parallel.fsdp_regather=step` the step gathers once at its start and reduce-scatters
once at its end, which is ZeRO-1's program. A leaf is sharded along a dimension of
one layer's weight (never the stacking of stages, chunks or layers), the largest that
divides evenly.

With expert parallelism (framework/parallel/expert.py) the batch is split over `data`
and `expert` together: a dense leaf's gradient is summed over both, and ZeRO-1/FSDP
shard it over both (one dimension split data x expert ways); a MoE layer's expert
leaf is already split over `expert` (different experts on each device), so its
gradient is summed, and ZeRO-1/FSDP shard it, over `data` only. The leaf's dimension
then carries its axes (`ShardDim`); a plain int is sharded over `data`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from framework.config import cast_at_use
from framework.parallel.mesh import DATA, EXPERT
from framework.parallel.rules import is_expert_leaf


class ShardDim(int):
    """A leaf's sharded dimension and the mesh axes it is sharded over (expert
    parallelism: `data` and `expert` for a dense leaf, `data` for an expert leaf)."""

    def __new__(cls, dim: int, axes):
        new = int.__new__(cls, dim)
        new.axes = axes
        return new

    def __repr__(self):
        return f"ShardDim({int(self)}, {self.axes})"


def shard_axes(dim):
    """The mesh axes a leaf's ZeRO-1/FSDP dimension is sharded over."""
    return getattr(dim, "axes", DATA)


def _sharding(spec, data: int, expert: int):
    """(ways, axes) a leaf with this spec is sharded over by ZeRO-1/FSDP."""
    if expert == 1:
        return data, DATA
    return (data // expert, DATA) if is_expert_leaf(spec) else (data, (DATA, EXPERT))


def _dim(d, axes):
    return d if d is None or axes == DATA else ShardDim(d, axes)


def zero1_dims(shapes, specs, data: int, expert: int = 1):
    """Per leaf: the dimension to shard over `data` (the largest dim not already
    sharded whose size divides evenly), or None to leave the leaf replicated. `data`:
    the data replicas; `expert`: the expert-parallel degree (module docstring)."""

    def pick(shape, spec):
        ways, axes = _sharding(spec, data, expert)
        spec = tuple(spec) + (None,) * (len(shape) - len(spec))
        free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % ways == 0]
        return _dim(max(free, key=lambda d: shape[d]), axes) if free and ways > 1 else None

    return jax.tree.map(lambda s, sp: pick(s.shape, sp), shapes, specs,
                        is_leaf=lambda x: isinstance(x, P))


def gathers_per_use(parallel) -> bool:
    """FSDP with every use gathering its weights (a ParallelConfig's settings)."""
    return parallel.fsdp and parallel.fsdp_regather == "microbatch" and parallel.data > 1


def fsdp_dims(shapes, specs, data: int, stacked: dict, expert: int = 1):
    """Per leaf: the dimension FSDP shards over `data`, one that a single use of the
    leaf has (`stacked[group]` leading dimensions of a group's leaves stack stages,
    chunks and layers), the largest not already sharded that divides evenly; None to
    leave it replicated."""

    def pick(group):
        def one(shape, spec):
            ways, axes = _sharding(spec, data, expert)
            spec = tuple(spec) + (None,) * (len(shape) - len(spec))
            free = [d for d in range(stacked.get(group, 0), len(shape))
                    if spec[d] is None and shape[d] % ways == 0]
            return _dim(max(free, key=lambda d: shape[d]), axes) if free and ways > 1 \
                else None
        return lambda s, sp: one(s.shape, sp)

    return {g: jax.tree.map(pick(g), shapes[g], specs[g], is_leaf=lambda x: isinstance(x, P))
            for g in shapes}


def narrowed(x, before: int, dtype) -> bool:
    """Whether every use casts leaf x (`before`: its dimensions before one use's) to
    the compute dtype `dtype` (None: no cast), narrower than its own: a matrix
    (`config.cast_at_use`). FSDP's and ZeRO-1's gathers send such leaves cast, and the
    tick executor's once-a-step weights (framework/engine/step_weights.py) cast them."""
    return dtype is not None and cast_at_use(x.ndim - before) and \
        jnp.dtype(dtype).itemsize < x.dtype.itemsize


def gather_leaves(tree, dims, offset: int = 0, dtype=None):
    """FSDP: the full leaves of one use from this replica's shards; `offset`: leading
    dimensions the stored leaves have and these do not (a layer's slice of a stack).
    `dtype`: the matrices (`config.cast_at_use`) are gathered in it
    where it is narrower than theirs, their gradients reduce-scattered in their own
    dtype (`_gather_as`); bfloat16 parameters travel as stored."""
    def one(x, d):
        if d is None:
            return x
        axes = shard_axes(d)
        if narrowed(x, 0, dtype):
            return _gather_as(x, d - offset, jnp.dtype(dtype), axes)
        return jax.lax.all_gather(x, axes, axis=d - offset, tiled=True)

    return jax.tree.map(one, tree, dims, is_leaf=lambda x: x is None)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_as(x, axis: int, dtype, axes=DATA):
    """all_gather(x cast to `dtype`): half the bytes of float32 for a bfloat16 compute
    dtype, the cast the use makes anyway done before the transfer. Its transpose
    reduce-scatters the gradient in x's dtype (the stored parameters', as without FSDP)."""
    return jax.lax.all_gather(x.astype(dtype), axes, axis=axis, tiled=True)


def _gather_as_fwd(x, axis, dtype, axes):
    return _gather_as(x, axis, dtype, axes), jnp.zeros((), x.dtype)  # x's dtype, for the bwd


def _gather_as_bwd(axis, dtype, axes, home, grad):
    return (jax.lax.psum_scatter(grad.astype(home.dtype), axes, scatter_dimension=axis,
                                 tiled=True),)


_gather_as.defvjp(_gather_as_fwd, _gather_as_bwd)


def add_data_axis(specs, dims):
    """PartitionSpecs with `data` placed on each leaf's ZeRO-1 dimension."""

    def one(spec, dim):
        if dim is None:
            return spec
        parts = list(spec) + [None] * (dim + 1 - len(spec))
        parts[dim] = shard_axes(dim)
        return P(*parts)

    return jax.tree.map(one, specs, dims, is_leaf=lambda x: isinstance(x, P) or x is None)


def gather_params(params, dims, dtype=None):
    """ZeRO-1: the full parameters for this step from this replica's shards
    ({'embed', 'head', 'stages' [stage, chunk, layer, ...]}). `dtype`: the layers' and
    the head's matrices (`config.cast_at_use`) travel in it where it is narrower than
    theirs, widened back after: every use casts them to it first, so the uses see the
    same values, for half the bytes of float32 in bfloat16 (the gradients are reduced
    apart, `reduce_gradients`, in the stored dtype). The embedding travels as stored
    (a lookup's rows)."""
    def one(x, d, offset):
        if d is None:
            return x
        axes = shard_axes(d)
        if offset is not None and narrowed(x, offset, dtype):
            return jax.lax.all_gather(x.astype(dtype), axes, axis=d, tiled=True).astype(x.dtype)
        return jax.lax.all_gather(x, axes, axis=d, tiled=True)

    offsets = {"stages": 3, "head": 0}  # the dimensions before one use's
    return {k: jax.tree.map(lambda x, d: one(x, d, offsets.get(k)), v, dims[k],
                            is_leaf=lambda x: x is None) for k, v in params.items()}


def reduce_gradients(grads, dims=None, reduced: bool = False, also: tuple = (),
                     expert_leaves=None):
    """The one reduction of the gradients over `data` per step: all-reduce every leaf,
    or with ZeRO-1 (`dims`) reduce-scatter each leaf onto its shard; `reduced`: FSDP's
    sharded leaves arrive reduce-scattered already (their gathers' transposes). `also`:
    mesh axes every gradient is summed over besides (`context`): in the same all-reduce,
    or after the reduce-scatter, on the shard. `expert_leaves` (expert parallelism: a
    bool per leaf): the dense leaves are summed over `expert` too (module docstring)."""
    if expert_leaves is not None:
        whole = lambda g, e: (DATA, *also) if e else (DATA, EXPERT, *also)
        if dims is None:
            return jax.tree.map(lambda g, e: jax.lax.psum(g, whole(g, e)), grads,
                                expert_leaves)
        then = (lambda g: jax.lax.psum(g, also)) if also else (lambda g: g)
        return jax.tree.map(
            lambda g, d, e: jax.lax.psum(g, whole(g, e)) if d is None else then(g)
            if reduced else then(jax.lax.psum_scatter(g, shard_axes(d), scatter_dimension=d,
                                                      tiled=True)),
            grads, dims, expert_leaves, is_leaf=lambda x: x is None)
    both = (DATA, *also)
    if dims is None:
        return jax.lax.psum(grads, both)
    then = (lambda g: jax.lax.psum(g, also)) if also else (lambda g: g)
    return jax.tree.map(
        lambda g, d: jax.lax.psum(g, both) if d is None else then(g) if reduced
        else then(jax.lax.psum_scatter(g, DATA, scatter_dimension=d, tiled=True)),
        grads, dims, is_leaf=lambda x: x is None)
