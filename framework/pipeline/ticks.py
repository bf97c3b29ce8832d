"""Executor for any table: runs every cell itself, backward included (1F1B, interleaved
1F1B, zero-bubble schedules; GPipe and circular tables too).

Autodiff of a forward loop keeps every microbatch's activations until the whole
backward runs. Here the tick loop carries the backward, so only the microbatches the
table keeps in flight hold memory. Each tick every rank runs the branch its cell names
(`lax.switch`):

  F(i, c)   x = the embedded microbatch (first stage) or its receive slot;
            y, vjp = jax.vjp(chunk c's layers); the VJP's residuals (the activations
            the backward needs; parameters are recognised by identity and never
            copied) go to the microbatch's stash slot. The last stage also runs head +
            loss and keeps dL/dy for its own backward.
  BW(i, c)  rebuild the VJP from the stash slot, pull the incoming gradient through it,
            accumulate the weight gradients, send dx on.
  B(i, c)   (split backward) the VJP w.r.t. the input and the weight matmuls' outputs
            only: dx is sent on, the matmul output gradients overwrite the (now dead)
            residuals in the stash slot, next to the matmul inputs F saved.
  W(i, c)   the weight gradients from that slot: one matmul per weight.

After the branch come the stash writes and the sends the buffer plan names for this
tick (`framework/pipeline/buffers.py`). A stash slot is one flat buffer per dtype, so
that B's output gradients can take the residuals' place (`Packing`): with a split
backward a microbatch in flight holds no more than 1F1B's full residuals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from framework.pipeline import StageFns
from framework.pipeline.autodiff import join_vjp, split_vjp
from framework.pipeline.buffers import ACT, GRAD, plan
from framework.pipeline.comm import (AXIS, ON_FIRST, ON_LAST, only_on, send, send_weights,
                                     slots, store, zeros_typed_like)
from framework.pipeline.schedule import BW, B, F, W, Schedule

CELL = "cell"  # scope of the per-tick dispatch (the profiler finds ticks by it)
LOOP = "pipeline_loop"
SCOPES = {F: "cell_forward", B: "cell_input_grad", W: "cell_weight_grad", BW: "cell_backward"}


def scope_weights(schedule: Schedule) -> dict[str, float]:
    """Share of (tick, rank) cells that run each branch; the head runs on the m F cells
    of the last stage, the embedding's gradient on the m backward cells of the first."""
    kind, m = schedule.kind, schedule.n_microbatches
    weights = {SCOPES[k]: float((kind == k).mean()) for k in SCOPES}
    weights[ON_LAST] = m / max(int((kind == F).sum()), 1)
    weights[ON_FIRST] = m / max(int(((kind == B) | (kind == BW)).sum()), 1)
    weights.update(send_weights(plan(schedule).channels, schedule.n_ticks))
    return weights


def _key(a) -> str:
    """Arrays of one key share a flat buffer: same dtype and same varying mesh axes."""
    return f"{a.dtype}|{','.join(sorted(jax.typeof(a).manual_axis_type.varying))}"


@dataclass(frozen=True)
class Packing:
    """Several lists of arrays stored, one list at a time, in one flat buffer per key
    (dtype and device-varying type, which the VJPs need back exactly)."""

    sizes: dict  # key -> elements

    @staticmethod
    def of(*likes) -> "Packing":
        sizes: dict = {}
        for like in likes:
            per: dict = {}
            for a in like:
                per[_key(a)] = per.get(_key(a), 0) + math.prod(a.shape)
            for key, n in per.items():
                sizes[key] = max(sizes.get(key, 0), n)
        return Packing(sizes)

    def zeros(self, n=None) -> dict:
        def one(key, size):
            dtype, axes = key.split("|")
            shape = (size,) if n is None else slots((size,), n)
            return zeros_typed_like(jax.ShapeDtypeStruct(shape, dtype), (), axes.split(",") if axes else ())
        return {key: one(key, size) for key, size in self.sizes.items()}

    def store(self, stash: dict, leaves, slot, keep) -> dict:
        """Writes `leaves` into row `slot` of the stash (the spare last row where not
        `keep`, see `comm.store`), each at its offset: no copy into one array first."""
        row = jnp.where(keep, slot, next(iter(stash.values())).shape[0] - 1)
        offset = dict.fromkeys(self.sizes, 0)
        stash = dict(stash)
        for a in leaves:
            key = _key(a)
            stash[key] = jax.lax.dynamic_update_slice(stash[key], a.reshape(1, -1),
                                                      (row, offset[key]))
            offset[key] += math.prod(a.shape)
        return stash

    def read(self, stash: dict, slot, like) -> list:
        """Arrays shaped like `like`, read from row `slot` of the stash at their offsets
        (only what is asked for is copied out of the row)."""
        offset = dict.fromkeys(self.sizes, 0)
        out = []
        for a in like:
            key, n = _key(a), math.prod(a.shape)
            out.append(jax.lax.dynamic_slice(stash[key], (slot, offset[key]), (1, n))
                       .reshape(a.shape))
            offset[key] += n
        return out


def loss_and_grads(schedule: Schedule, fns: StageFns, params, inputs, targets):
    """params: {'embed', 'head', 'chunks' [v, Lc, ...] of this rank}, varying over the
    manual axes. inputs, targets: [microbatches, mb, seq]. Returns (this rank's loss
    share, gradients like params)."""
    buffers = plan(schedule)
    v, S, split = schedule.n_chunks, schedule.n_global_stages, schedule.split_backward
    if split and fns.split is None:
        raise ValueError(f"schedule {schedule.name} splits the backward: StageFns.split is needed")
    rank = jax.lax.axis_index(AXIS)
    manual = tuple(sorted(jax.typeof(inputs).manual_axis_type.varying | {AXIS}))
    chunk_weights = lambda c: jax.tree.map(lambda a: a[0] if v == 1 else a[c], params["chunks"])

    def zeros(like, n=None):  # like `like` (n slots of it), varying at least over `manual`
        shape = like.shape if n is None else slots(like.shape, n)
        return zeros_typed_like(jax.ShapeDtypeStruct(shape, like.dtype), manual,
                                jax.typeof(like).manual_axis_type.varying)

    # Types of a message and of the stash contents: one forward traced for its shapes
    # only (dead code the compiler drops).
    w0 = chunk_weights(0)
    x_like = fns.embed(params["embed"], inputs[0])
    if split:
        _, vjp_like, saved_like = fns.split.forward(w0, x_like)
        dout_like = jax.tree.leaves(vjp_like(x_like)[1])
    else:
        vjp_like = jax.vjp(fns.layers, w0, x_like)[1]
        saved_like, dout_like = [], []
    res_like, treedef, param_slot = split_vjp(vjp_like, w0)
    saved_def = jax.tree.structure(saved_like)
    saved_like = jax.tree.leaves(saved_like)
    dout_def = jax.tree.structure(vjp_like(x_like)[1]) if split else None
    packing = Packing.of(res_like, dout_like)
    no_res = lambda: [zeros(a) for a in res_like]
    no_dout = lambda: [zeros(a) for a in dout_like]

    def embed_grad(dx, mb):
        return jax.vjp(lambda e: fns.embed(e, inputs[mb]), params["embed"])[1](dx)[0]

    def add(tree, update):
        return jax.tree.map(jnp.add, tree, update)

    def add_chunk(grads, c, g):
        return dict(grads, chunks=jax.tree.map(
            lambda a, u: a.at[0].add(u) if v == 1 else a.at[c].add(u), grads["chunks"], g))

    # Branches: (grads, loss, x_in, dy_in, stash, saved, k, mb, c, first, last) ->
    #   (grads, loss, act_out, grad_out, stash, saved). The stash buffers go in and come
    # out whole: a branch that writes a slot updates it in place, the others pass them
    # through, and no tick copies a slot it does not use.
    def idle(g, loss, x_in, dy_in, stash, saved, k, mb, c, first, last):
        return g, loss, zeros(x_like), zeros(x_like), no_res(), no_dout(), [zeros(a) for a in saved_like]

    def forward(g, loss, x_in, dy_in, stash, saved_buf, k, mb, c, first, last):
        x = only_on(ON_FIRST, first, lambda: fns.embed(params["embed"], inputs[mb]), lambda: x_in)
        w = chunk_weights(c)
        if split:
            y, vjp_fn, saved = fns.split.forward(w, x)
            saved_buf = jax.tree.leaves(saved)
        else:
            y, vjp_fn = jax.vjp(fns.layers, w, x)
            saved_buf = []

        def head():  # last stage: this microbatch's loss and dL/dy for its backward
            l, (g_head, g_embed, dy) = jax.value_and_grad(fns.head_loss, argnums=(0, 1, 2))(
                params["head"], params["embed"], y, targets[mb])
            return dict(g, head=add(g["head"], g_head), embed=add(g["embed"], g_embed)), loss + l, dy

        g, loss, dy = only_on(ON_LAST, last, head, lambda: (g, loss, zeros(x_like)))
        return g, loss, y, dy, split_vjp(vjp_fn, w)[0], no_dout(), saved_buf

    def backward(g, loss, x_in, dy_in, stash, saved, k, mb, c, first, last):
        w = chunk_weights(c)
        vjp_fn = join_vjp(packing.read(stash, k, res_like), treedef, param_slot, w)
        if split:  # B: the gradients of the input and of the matmul outputs
            dx, dout = vjp_fn(dy_in)
            dout = jax.tree.leaves(dout)
        else:  # BW: the gradients of the input and of the weights
            g_w, dx = vjp_fn(dy_in)
            g = add_chunk(g, c, g_w)
            dout = no_dout()
        g_embed = only_on(ON_FIRST, first, lambda: embed_grad(dx, mb),
                          lambda: jax.tree.map(jnp.zeros_like, params["embed"]))
        return (dict(g, embed=add(g["embed"], g_embed)), loss, zeros(x_like), dx, no_res(), dout,
                [zeros(a) for a in saved_like])

    def weight(g, loss, x_in, dy_in, stash, saved_buf, k, mb, c, first, last):
        w = chunk_weights(c)
        saved = jax.tree.unflatten(saved_def, [buf[k] for buf in saved_buf])
        douts = jax.tree.unflatten(dout_def, packing.read(stash, k, dout_like))
        g_w = fns.split.weight_grads(w, saved, douts)
        return (add_chunk(g, c, g_w), loss, zeros(x_like), zeros(x_like), no_res(), no_dout(),
                [zeros(a) for a in saved_like])

    def scoped(kind, fn):
        def run(*args):
            with jax.named_scope(SCOPES[kind]):
                return fn(*args)
        return run

    # Indexed by cell kind; the kinds a table does not use are never traced.
    branches = [idle, scoped(F, forward)] + ([scoped(B, backward), scoped(W, weight), idle]
                                             if split else [idle, idle, scoped(BW, backward)])
    stage = schedule.global_stage
    xs = jax.tree.map(jnp.asarray, {
        "kind": schedule.kind, "mb": schedule.microbatch, "chunk": schedule.chunk,
        "stash": buffers.stash, "read": buffers.read,
        "first": stage == 0, "last": stage == S - 1,
        "arrive": [ch.arrive for ch in buffers.channels],
        "pattern": [ch.pattern for ch in buffers.channels]})

    def tick(carry, row):
        recv, stash, saved_buf, g, loss = carry
        kind, mb, c = row["kind"][rank], row["mb"][rank], row["chunk"][rank]
        k_read, k_stash = (jnp.maximum(row[n][rank], 0) for n in ("read", "stash"))
        # What the cell reads, taken out of the buffers before the switch, so that the
        # conditional's operands are one slot each, not the buffers.
        x_in = recv[ACT][k_read] if ACT in recv else zeros(x_like)
        dy_in = recv[GRAD][k_read] if GRAD in recv else zeros(x_like)
        with jax.named_scope(CELL):
            g, loss, act_out, grad_out, res_out, dout_out, new_saved = jax.lax.switch(
                kind, branches, g, loss, x_in, dy_in, stash, saved_buf, k_stash, mb, c,
                row["first"][rank], row["last"][rank])
        stash = packing.store(stash, res_out, k_stash, kind == F)
        if split:
            stash = packing.store(stash, dout_out, k_stash, kind == B)
        saved_buf = [store(buf, e, k_stash, kind == F) for buf, e in zip(saved_buf, new_saved)]
        outs = {ACT: act_out, GRAD: grad_out}
        for ch, arrive, pattern in zip(buffers.channels, row["arrive"], row["pattern"]):
            got = send(ch, pattern, outs[ch.buffer])
            recv = dict(recv, **{ch.buffer: store(recv[ch.buffer], got, arrive[rank],
                                                  arrive[rank] >= 0)})
        return (recv, stash, saved_buf, g, loss), None

    n = buffers.n_slots
    recv = {buf: zeros(x_like, n[buf]) for buf in (ACT, GRAD) if n[buf]}
    stash = packing.zeros(n["stash"])
    init = (recv, stash, [zeros(a, n["stash"]) for a in saved_like],
            jax.tree.map(zeros, params), zeros(jnp.zeros((), jnp.float32)))
    with jax.named_scope(LOOP):
        (_, _, _, grads, loss), _ = jax.lax.scan(tick, init, xs)
    return loss, grads
