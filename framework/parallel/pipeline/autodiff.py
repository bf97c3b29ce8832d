"""Executor for GPipe and circular tables: runs the forward rows, autodiff the rest.

Every rank runs the same tick loop over the table's forward rows: on an F cell it
applies its layer chunk to its input (the embedded microbatch on the first stage, else
the receive slot the buffer plan names) and the send channels pass the output on.
`jax.value_and_grad` of the whole loop runs it backwards: the mirrored half of the
table, with every forward tick's residuals kept until then (GPipe's memory).

Idle cells skip the layers and their tensor-parallel collectives (`stage_or_skip`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from framework.parallel.mesh import PIPE
from framework.parallel.pipeline import StageFns
from framework.parallel.pipeline.buffers import ACT, plan
from framework.parallel.pipeline.comm import (only_on, send, send_weights, slots, store,
                                              zeros_typed_like)
from framework.parallel.pipeline.schedule import F, Schedule
from framework.parallel.pipeline.scopes import CELL, LOOP, ON_FIRST, ON_LAST, STAGE


def scope_weights(schedule: Schedule) -> dict[str, float]:
    rows = schedule.forward_rows()
    p = schedule.n_stages
    weights = {ON_FIRST: 1 / p, ON_LAST: 1 / p, STAGE: float((rows.kind == F).mean())}
    weights.update(send_weights(plan(schedule).channels, rows.n_ticks))
    return weights


def forward(schedule: Schedule, fns: StageFns, params, inputs, targets, n_tokens=None):
    """This rank's share of the mean loss (nonzero on the last rank), by running the
    forward rows. params: {'embed', 'head', 'chunks' [v, Lc, ...]}; inputs, targets:
    [microbatches, mb, seq]."""
    rows, buffers = schedule.forward_rows(), plan(schedule)
    p, v, S = schedule.n_stages, schedule.n_chunks, schedule.n_global_stages
    rank = jax.lax.axis_index(PIPE)
    first, last = (rank == 0, rank == p - 1) if p > 1 else (True, True)
    manual = tuple(sorted(jax.typeof(inputs).manual_axis_type.varying | {PIPE}))
    m, mb, seq = inputs.shape
    x_like = fns.embed(params["embed"], inputs[0])  # its type only (dead code)
    embed_all = lambda: fns.embed(params["embed"], inputs.reshape(m * mb, seq)).reshape(
        (m,) + x_like.shape)  # [micro, mb, seq(/tensor), embed]
    x_mb = only_on(ON_FIRST, first, embed_all, lambda: zeros_typed_like(
        jax.ShapeDtypeStruct((m,) + x_like.shape, x_like.dtype), manual,
        jax.typeof(x_like).manual_axis_type.varying))
    stage = rows.global_stage
    xs = {"kind": rows.kind, "mb": rows.microbatch, "chunk": rows.chunk, "read": buffers.read,
          "stage": stage,
          "first": stage == 0, "last": stage == S - 1,
          "arrive": [ch.arrive for ch in buffers.channels],
          "pattern": [ch.pattern for ch in buffers.channels]}
    xs = jax.tree.map(jnp.asarray, xs)

    def tick(carry, row):
        recv, outputs = carry
        busy = row["kind"][rank] == F
        mb, c, slot = row["mb"][rank], row["chunk"][rank], row["read"][rank]
        x = jnp.where(row["first"][rank], x_mb[mb], recv[jnp.maximum(slot, 0)]) if recv is not None else x_mb[mb]
        # v = 1: a static index keeps the weights loop-invariant (not saved per tick).
        weights = jax.tree.map(lambda a: a[0] if v == 1 else a[c], params["chunks"])
        with jax.named_scope(CELL):
            n_real = fns.real(row["stage"][rank])  # uneven stages, else None
            y = (stage_or_skip(fns.layers, weights, x, busy, n_real) if S > 1
                 else fns.layers(weights, x, n_real=n_real))
        done = busy & row["last"][rank]
        outputs = outputs.at[mb].set(jnp.where(done, y, outputs[mb]))
        for ch, arrive, pattern in zip(buffers.channels, row["arrive"], row["pattern"]):
            recv = store(recv, send(ch, pattern, y), arrive[rank], arrive[rank] >= 0)
        return (recv, outputs), None

    n_act = buffers.n_slots[ACT]
    typed = lambda shape: zeros_typed_like(jax.ShapeDtypeStruct(shape, x_mb.dtype), manual,
                                           jax.typeof(x_mb).manual_axis_type.varying)
    recv = typed(slots(x_mb.shape[1:], n_act)) if n_act else None
    init = (recv, typed(x_mb.shape))
    with jax.named_scope(LOOP):
        (_, outputs), _ = jax.lax.scan(tick, init, xs, unroll=rows.n_ticks == 1)
    loss = lambda: head_loss_by_microbatch(fns, params, outputs, targets)
    return only_on(ON_LAST, last, loss, lambda: zeros_typed_like(loss()))  # loss(): its type


def head_loss_by_microbatch(fns: StageFns, params, y_mb, targets_mb):
    """Head + loss one microbatch at a time, recomputed in the backward, so only one
    microbatch's [mb, seq, vocab/tensor] logits are ever alive (not the batch's)."""
    loss = lambda y, t: fns.head_loss(params["head"], params["embed"], y, t)
    if y_mb.shape[0] == 1:  # one microbatch: nothing to save by recomputing
        return loss(y_mb[0], targets_mb[0])
    one = jax.checkpoint(loss)
    total = zeros_typed_like(loss(y_mb[0], targets_mb[0]))  # its type only (dead code)
    total, _ = jax.lax.scan(lambda acc, yt: (acc + one(*yt), None), total, (y_mb, targets_mb))
    return total


def loss_and_grads(schedule: Schedule, fns: StageFns, params, inputs, targets):
    """(this rank's loss share, gradients like params) by autodiff of `forward`."""
    return jax.value_and_grad(forward, argnums=2)(schedule, fns, params, inputs, targets)


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
    missing = set(jax.typeof(x).manual_axis_type.varying) - set(
        jax.typeof(real).manual_axis_type.varying)
    if missing:  # a residual: typed like the activations beside it (the tick stash)
        real = jax.lax.pcast(real, tuple(sorted(missing)), to="varying")
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

    def bwd(saved, d_out):
        weights, acts, real = saved
        dy = d_out[0] if has_aux else d_out
        work = lambda: join_vjp(acts, treedef, slots, weights)(dy)
        skip = lambda: (jax.tree.map(zeros_typed_like, weights), dy)
        return (*_cond(scope, real, work, skip), None, None)

    run = jax.custom_vjp(lambda w, x, r, e: _cond(scope, r, lambda: bound(e)(w, x),
                                                  lambda: skipped(x)))
    run.defvjp(fwd, bwd)
    return run(weights, x, real, extra)


def stage_or_skip(layers, weights, x, busy, n_real=None):
    """layers(weights, x, n_real=n_real) on a busy tick, x unchanged on a bubble tick,
    forward and backward (`skip_unless`): idle ranks skip the layers and their
    tensor-parallel collectives; only the activations are saved per tick."""
    return skip_unless(busy, lambda w, x, n: layers(w, x, n_real=n), weights, x, n_real,
                       scope=STAGE)
