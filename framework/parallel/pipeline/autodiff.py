"""Executor for GPipe and circular tables: runs the forward rows, autodiff the rest;
without a pipeline, gradient accumulation over the microbatches (`accumulated`).

Every rank runs the same tick loop over the table's forward rows: on an F cell it
applies its layer chunk to its input (the embedded microbatch on the first stage, else
the receive slot the buffer plan names) and the send channels pass the output on.
`jax.value_and_grad` of the whole loop runs it backwards: the mirrored half of the
table, with every forward tick's residuals kept until then (GPipe's memory).

Idle cells skip the layers and their tensor-parallel collectives (`stage_or_skip`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from framework.parallel.mesh import PIPE
from framework.parallel.pipeline.comm import (manual_axes, only_on, send, slots, store,
                                              zeros_typed_like)
from framework.parallel.pipeline.kinds import ACT, F
from framework.parallel.pipeline.program import Program
from framework.parallel.pipeline.scopes import (ACCUMULATE, CELL, LOOP, ON_FIRST, ON_LAST,
                                                 STAGE)
from framework.parallel.pipeline.stage import StageFns, no_float0, of_microbatch, skip_unless


def forward(prog: Program, fns: StageFns, params, inputs, targets, docs=None):
    """This rank's share of the mean loss (nonzero on the last rank), by running the
    forward rows. params: {'embed', 'head', 'chunks' [v, Lc, ...]}; inputs, targets:
    [microbatches, mb, seq]; docs: the microbatches' document masks (leaves
    [microbatches, mb, ...], framework/model/documents.py) or None."""
    buffers, v = prog.buffers, prog.schedule.n_chunks
    p, S = prog.schedule.n_stages, prog.schedule.n_global_stages
    rank = jax.lax.axis_index(PIPE)
    # The ranks of the first and the last global stage (a V puts both on rank 0).
    on = lambda g: rank == int(prog.stages.rank[g]) if p > 1 else True
    first, last = on(0), on(S - 1)
    manual = manual_axes(inputs)
    m, mb, seq = inputs.shape
    x_like = fns.embed(params["embed"], inputs[0], of_microbatch(docs, 0))  # type (dead code)
    merged = None if docs is None else jax.tree.map(  # [micro * mb, ...]
        lambda a: a.reshape((m * mb,) + a.shape[2:]), docs)
    embed_all = lambda: fns.embed(params["embed"], inputs.reshape(m * mb, seq), merged).reshape(
        (m,) + x_like.shape)  # [micro, mb, seq(/tensor), embed]
    x_mb = only_on(ON_FIRST, first, embed_all, lambda: zeros_typed_like(
        jax.ShapeDtypeStruct((m,) + x_like.shape, x_like.dtype), manual,
        jax.typeof(x_like).manual_axis_type.varying))
    xs = jax.tree.map(jnp.asarray, prog.scan_inputs())

    def tick(carry, row):
        recv, outputs = carry
        busy = row["kind"][rank] == F
        mb, c, slot = row["mb"][rank], row["chunk"][rank], row["read"][rank]
        x = jnp.where(row["first"][rank], x_mb[mb], recv[jnp.maximum(slot, 0)]) if recv is not None else x_mb[mb]
        # v = 1: a static index keeps the weights loop-invariant (not saved per tick).
        weights = jax.tree.map(lambda a: a[0] if v == 1 else a[c], params["chunks"])
        with jax.named_scope(CELL):
            n_real = prog.real(row["stage"][rank])  # uneven stages, else None
            first = prog.first(row["stage"][rank], jax.tree.leaves(weights)[0].shape[0])
            docs_mb = of_microbatch(docs, mb)
            y = (stage_or_skip(fns.layers, weights, x, busy, n_real, docs_mb, first) if S > 1
                 else fns.layers(weights, x, n_real=n_real, docs=docs_mb, first=first))
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
        (_, outputs), _ = jax.lax.scan(tick, init, xs, unroll=len(xs["kind"]) == 1)
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


def loss_and_grads(prog: Program, fns: StageFns, params, inputs, targets, docs=None):
    """(this rank's loss share, gradients like params) by autodiff of `forward`; None
    for an integer leaf's (the E4M3 bits of ZeRO-1's FP8 gathers: no gradient).
    Without a pipeline, several microbatches accumulate (`accumulates`)."""
    if accumulates(prog):
        return accumulated(prog, fns, params, inputs, targets, docs)
    loss, grads = jax.value_and_grad(forward, argnums=2, allow_int=True)(
        prog, fns, params, inputs, targets, docs)
    return loss, no_float0(grads)


def accumulates(prog: Program) -> bool:
    """One stage of one chunk (no pipeline) and several microbatches: gradient
    accumulation, where autodiff of the tick loop would keep every microbatch's
    residuals until its backward."""
    return prog.schedule.n_global_stages == 1 and prog.schedule.n_microbatches > 1


def accumulated(prog: Program, fns: StageFns, params, inputs, targets, docs=None):
    """(loss, gradients) of one stage over m microbatches, each microbatch's forward
    and backward in turn and their sums carried (gradient accumulation): one
    microbatch's residuals alive at a time. Each microbatch's loss is its share of
    the whole batch's mean (the head divides by the step's tokens), so the sums are
    the step's. inputs, targets: [m, mb, seq]."""
    chunk_layers = jax.tree.leaves(params["chunks"])[0].shape[1]  # chunks: [1, Lc, ...]
    n_real, first = prog.real(0), prog.first(0, chunk_layers)

    def one(params, ids, target, docs_mb):
        x = fns.embed(params["embed"], ids, docs_mb)
        with jax.named_scope(CELL):
            y = fns.layers(jax.tree.map(lambda a: a[0], params["chunks"]), x,
                           n_real=n_real, docs=docs_mb, first=first)
        return fns.head_loss(params["head"], params["embed"], y, target)

    grad = lambda i: no_float0(jax.value_and_grad(one, allow_int=True)(
        params, inputs[i], targets[i], of_microbatch(docs, i)))
    # zeros typed as the sums are (grad(0) traced for its types only: dead code). Every
    # microbatch in the loop: a first one outside it, beside a loop of one trip that
    # the compiler inlines, was scheduled together with it (both alive at once).
    zeros = jax.tree.map(zeros_typed_like, grad(0))
    with jax.named_scope(LOOP):
        return jax.lax.fori_loop(0, inputs.shape[0], lambda i, total: _added(total, grad(i)),
                                 zeros)


def _added(total, grads):
    """The step's sums += a microbatch's (loss, gradients)."""
    with jax.named_scope(ACCUMULATE):
        return jax.tree.map(jnp.add, total, grads)


def stage_or_skip(layers, weights, x, busy, n_real=None, docs=None, first=None):
    """layers(weights, x, n_real=n_real, docs=docs, first=first) on a busy tick, x unchanged on a
    bubble tick, forward and backward (`skip_unless`): idle ranks skip the layers and
    their tensor-parallel collectives; only the activations are saved per tick."""
    return skip_unless(busy, lambda w, x, n, d, f: layers(w, x, n_real=n, docs=d, first=f),
                       weights, x, n_real, docs, first, scope=STAGE)
