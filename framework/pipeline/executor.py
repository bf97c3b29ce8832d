"""Executes the forward rows of a GPipe or circular schedule table on one pipe rank.

Runs inside a `shard_map` that is manual over `pipe`: every rank runs the same tick
loop, reads its own action from the table, applies its layer chunk and passes the
result to the next rank with `ppermute`. The backward pass is JAX autodiff of this
loop, which replays the table's ticks in reverse (the mirrored half of the table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from framework.pipeline.schedule import FWD, Schedule

AXIS = "pipe"
# Named scopes around work only some ranks do. The communication audit reads them from
# the compiled program's op names to count those collectives for those ranks only.
ON_FIRST, ON_LAST = "on_first_stage", "on_last_stage"
SEND = "pipe_send"  # ticks on which some rank sends an activation on
STAGE = "stage_work"  # a rank's ticks with a real microbatch (not the bubble)


def only_on(scope: str, pred, fn, otherwise):
    """`fn()` where `pred` holds (this rank), `otherwise()` elsewhere: the other ranks
    skip the work and its collectives instead of computing and discarding it. A Python
    bool `pred` (e.g. with a single pipeline rank) picks the branch at trace time."""

    def run():
        with jax.named_scope(scope):
            return fn()

    if isinstance(pred, bool):
        return run() if pred else otherwise()
    return jax.lax.cond(pred, run, otherwise)


def varying(x, axes=(AXIS,)):
    """Marks x as (possibly) different on each device of `axes` (a shard_map type)."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def run_forward(schedule: Schedule, stage_fn, chunks, x_mb):
    """chunks: this rank's parameters [n_chunks, layers_per_chunk, ...].
    x_mb: [microbatches, mb, seq, embed], the embedded inputs (read by rank 0).
    Returns (outputs [microbatches, mb, seq, embed], meaningful on the last rank;
    useful: how many ticks this rank spent on a real microbatch)."""
    table = schedule.executed_rows()
    p, v = schedule.n_stages, schedule.n_chunks
    rank = jax.lax.axis_index(AXIS)
    ring = [(i, (i + 1) % p) for i in range(p)] if v > 1 else [(i, i + 1) for i in range(p - 1)]
    rows = {k: jnp.asarray(getattr(table, k)) for k in ("action", "microbatch", "chunk")}
    rows["send"] = jnp.asarray(table.sends(FWD))  # the same on every rank

    def tick(carry, row):
        recv, parked, outputs, useful = carry
        valid = row["action"][rank] == FWD
        mb, chunk = row["microbatch"][rank], row["chunk"][rank]
        # Rank 0 starts a microbatch (chunk 0) or takes it back from the ring (chunk > 0).
        first = x_mb[mb] if v == 1 else jnp.where(chunk == 0, x_mb[mb], parked[mb])
        # GPipe: a static index keeps the weights loop-invariant (not saved per tick).
        weights = jax.tree.map(lambda c: c[0] if v == 1 else c[chunk], chunks)
        x = jnp.where(rank == 0, first, recv)
        out = stage_or_skip(stage_fn, weights, x, valid) if p > 1 else stage_fn(weights, x)
        done = valid & (rank == p - 1) & (chunk == v - 1)
        outputs = outputs.at[mb].set(jnp.where(done, out, outputs[mb]))
        if p > 1:  # skipped on ticks where no rank has anything to pass on
            recv = only_on(SEND, row["send"], lambda: jax.lax.ppermute(out, AXIS, ring), lambda: out)
        else:
            recv = out
        if v > 1:  # rank 0 parks what the last rank sent until its turn comes
            last_mb, last_chunk = row["microbatch"][p - 1], row["chunk"][p - 1]
            park = (rank == 0) & (row["action"][p - 1] == FWD) & (last_chunk < v - 1)
            parked = parked.at[last_mb].set(jnp.where(park, recv, parked[last_mb]))
        return (recv, parked, outputs, useful + valid.astype(jnp.int32)), None

    axes = (AXIS,) + tuple(sorted(jax.typeof(x_mb).manual_axis_type.varying - {AXIS}))
    zeros = lambda shape, dtype=x_mb.dtype: varying(jnp.zeros(shape, dtype), axes)
    parked = zeros(x_mb.shape) if v > 1 else None  # rank 0's ring buffer, by microbatch
    init = (zeros(x_mb.shape[1:]), parked, zeros(x_mb.shape), varying(jnp.zeros((), jnp.int32)))
    # One tick (no pipeline, one microbatch): no loop at all, as in a plain step.
    (_, _, outputs, useful), _ = jax.lax.scan(tick, init, rows,
                                              unroll=len(table.action) == 1)
    return outputs, useful


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


def stage_or_skip(stage_fn, weights, x, busy):
    """stage_fn(weights, x) on a busy tick, x unchanged on a bubble tick, forward and
    backward: idle ranks skip the layers and their tensor-parallel collectives (all
    devices of a `tensor` group share the rank, so they take the same branch).

    A plain `lax.cond` would do, except that its autodiff saves the weights it reads
    as a per-tick residual of the tick loop. Here the backward gets the weights as the
    forward's own input, which the loop's autodiff keeps once (loop-invariant), and
    only the activations are saved per tick."""
    _, probe = jax.vjp(stage_fn, weights, x)  # the residuals' types (dead code)
    acts_like, treedef, slots = split_vjp(probe, weights)

    def forward(weights, x, busy):  # -> (y, what the backward needs)
        def work():
            y, vjp_fn = jax.vjp(stage_fn, weights, x)
            return y, split_vjp(vjp_fn, weights)[0]
        skip = lambda: (x, [_zeros_typed_like(a) for a in acts_like])
        y, acts = only_on(STAGE, busy, work, skip)
        return y, (weights, acts, busy)

    def backward(saved, dy):
        weights, acts, busy = saved
        work = lambda: join_vjp(acts, treedef, slots, weights)(dy)
        skip = lambda: (jax.tree.map(_zeros_typed_like, weights), dy)
        g_weights, dx = only_on(STAGE, busy, work, skip)
        return g_weights, dx, None

    run = jax.custom_vjp(lambda w, x, b: only_on(STAGE, b, lambda: stage_fn(w, x), lambda: x))
    run.defvjp(forward, backward)
    return run(weights, x, busy)


def _zeros_typed_like(a):
    return varying(jnp.zeros(a.shape, a.dtype), tuple(sorted(jax.typeof(a).manual_axis_type.varying)))
