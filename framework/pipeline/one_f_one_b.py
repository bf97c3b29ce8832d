"""Executes a 1F1B schedule table on one pipe rank, backward included.

GPipe lets autodiff differentiate the whole forward tick loop, so every microbatch's
activations stay alive until the backward starts. 1F1B instead interleaves: after a
few warm-up forwards each stage alternates a forward of one microbatch with the
backward of an older one. In SPMD JAX that means the tick loop itself must carry the
backward:

  forward  F(i): y, vjp = jax.vjp(stage, params, x). The VJP's residuals (the
           activations the backward needs; parameters are excluded, they are shared)
           go into a stash slot. The last stage also runs head + loss and keeps dL/dy.
  backward B(i): rebuild the VJP from stash slot i, pull the incoming gradient through
           it, accumulate the parameter gradients, send dx to the previous stage.

Only as many microbatches as the table keeps in flight (at most `pipeline` on stage 0)
hold a stash slot, so activation memory no longer grows with the microbatch count.
Each tick every rank runs the branch its table cell names (`lax.switch`: idle, F or B),
then activations move one stage forward and gradients one stage back (`ppermute`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from framework.pipeline.executor import (AXIS, ON_FIRST, ON_LAST, join_vjp, only_on, split_vjp,
                                         varying)
from framework.pipeline.schedule import BWD, FWD, IDLE, Schedule


FORWARD, BACKWARD = "f1b_forward", "f1b_backward"  # named scopes, for the audit
SEND_FORWARD, SEND_BACKWARD = "pipe_send_forward", "pipe_send_backward"


def run_1f1b(schedule: Schedule, stage_fn, embed_fn, head_loss_fn, params, inputs, targets):
    """params: {'embed', 'chunk' ([layers_per_stage, ...] of this rank), 'head'},
    already varying over the manual axes. inputs/targets: [microbatches, mb, seq].
    embed_fn(embed_params, ids) -> x; stage_fn(chunk_params, x) -> y;
    head_loss_fn(head_params, embed_params, y, targets) -> this microbatch's loss share.
    Returns (loss share of this rank, grads like params, useful ticks of this rank)."""
    p = schedule.n_stages
    rank = jax.lax.axis_index(AXIS)
    is_first, is_last = rank == 0, rank == p - 1
    rows = {k: jnp.asarray(getattr(schedule, k)) for k in ("action", "microbatch")}
    rows["send_f"] = jnp.asarray(schedule.sends(FWD))  # the same on every rank
    rows["send_b"] = jnp.asarray(schedule.sends(BWD))
    n_stash = int(schedule.max_in_flight().max())
    n_recv = max(1, schedule.max_pending(FWD), schedule.max_pending(BWD))
    base = jax.typeof(inputs).manual_axis_type.varying | {AXIS}

    def zeros(like, n=None):
        """Zeros shaped like `like` (with n slots in front), of a type at least as
        device-varying as `like`, as the loop carry needs."""
        axes = base | jax.typeof(like).manual_axis_type.varying
        shape = like.shape if n is None else (n,) + like.shape
        return varying(jnp.zeros(shape, like.dtype), tuple(sorted(axes)))

    # Trace one forward to learn the stash's shapes (the values are dead code, which
    # the compiler drops; eval_shape cannot trace shard_map's varying types).
    x_shape = embed_fn(params["embed"], inputs[0])
    acts_shape, _, _ = split_vjp(jax.vjp(stage_fn, params["chunk"], x_shape)[1], params["chunk"])
    stash = [zeros(a, n_stash) for a in acts_shape]
    buf = zeros(x_shape, n_recv)

    # Each branch takes the carry `c` and the (read-only) stash, and returns the carry,
    # the messages to send and the new stash entry; the stash is written after the
    # switch, so the compiler need not copy it into and out of the conditional.
    def forward(c, stash, mb):
        with jax.named_scope(FORWARD):
            return _forward(c, mb)

    def _forward(c, mb):
        x = only_on(ON_FIRST, is_first, lambda: embed_fn(params["embed"], inputs[mb]),
                    lambda: c["recv_f"][mb % n_recv])
        y, vjp_fn = jax.vjp(stage_fn, params["chunk"], x)
        acts, _, _ = split_vjp(vjp_fn, params["chunk"])

        def head(c):  # last stage: loss of this microbatch and dL/dy for its backward
            loss, (g_head, g_embed, dy) = jax.value_and_grad(head_loss_fn, argnums=(0, 1, 2))(
                params["head"], params["embed"], y, targets[mb])
            c = dict(c, loss=c["loss"] + loss, dy=c["dy"].at[mb % n_stash].set(dy))
            c["grads"] = dict(c["grads"], head=_add(c["grads"]["head"], g_head),
                              embed=_add(c["grads"]["embed"], g_embed))
            return c

        c = only_on(ON_LAST, is_last, lambda: head(c), lambda: c)
        return c, y, jnp.zeros_like(y), acts

    def backward(c, stash, mb):
        with jax.named_scope(BACKWARD):
            return _backward(c, stash, mb)

    def _backward(c, stash, mb):
        dy = jnp.where(is_last, c["dy"][mb % n_stash], c["recv_b"][mb % n_recv])
        _, probe = jax.vjp(stage_fn, params["chunk"], jnp.zeros_like(dy))  # structure only
        _, treedef, slots = split_vjp(probe, params["chunk"])
        acts = [s[mb % n_stash] for s in stash]
        g_chunk, dx = join_vjp(acts, treedef, slots, params["chunk"])(dy)
        g_embed = only_on(
            ON_FIRST, is_first,
            lambda: jax.vjp(lambda e: embed_fn(e, inputs[mb]), params["embed"])[1](dx)[0],
            lambda: jax.tree.map(jnp.zeros_like, params["embed"]))
        c["grads"] = dict(c["grads"], chunk=_add(c["grads"]["chunk"], g_chunk),
                          embed=_add(c["grads"]["embed"], g_embed))
        return c, jnp.zeros_like(dx), dx, no_acts(stash)

    def idle(c, stash, mb):
        return c, jnp.zeros_like(buf[0]), jnp.zeros_like(buf[0]), no_acts(stash)

    def no_acts(stash):
        return [jnp.zeros_like(s[0]) for s in stash]

    def tick(carry, row):
        c, stash = carry
        act, mb = row["action"][rank], row["microbatch"][rank]
        c, send_f, send_b, acts = jax.lax.switch(act, [idle, forward, backward], c, stash, mb)
        stash = [_store(s, a, mb % n_stash, act == FWD) for s, a in zip(stash, acts)]
        c["useful"] = c["useful"] + (act != IDLE).astype(jnp.int32)
        if p > 1:  # activations one stage forward, gradients one stage back
            got_f = only_on(SEND_FORWARD, row["send_f"], lambda: jax.lax.ppermute(
                send_f, AXIS, [(i, i + 1) for i in range(p - 1)]), lambda: send_f)
            got_b = only_on(SEND_BACKWARD, row["send_b"], lambda: jax.lax.ppermute(
                send_b, AXIS, [(i + 1, i) for i in range(p - 1)]), lambda: send_b)
            prev, nxt = jnp.maximum(rank - 1, 0), jnp.minimum(rank + 1, p - 1)
            c["recv_f"] = _store(c["recv_f"], got_f, row["microbatch"][prev] % n_recv,
                                 (rank > 0) & (row["action"][prev] == FWD))
            c["recv_b"] = _store(c["recv_b"], got_b, row["microbatch"][nxt] % n_recv,
                                 (rank < p - 1) & (row["action"][nxt] == BWD))
        return (c, stash), None

    carry = {
        "recv_f": buf, "recv_b": buf,
        "dy": zeros(x_shape, n_stash),
        "grads": jax.tree.map(zeros, params), "loss": zeros(jnp.zeros((), jnp.float32)),
        "useful": varying(jnp.zeros((), jnp.int32)),
    }
    (carry, _), _ = jax.lax.scan(tick, (carry, stash), rows)
    return carry["loss"], carry["grads"], carry["useful"]


def _add(acc, g):
    return jax.tree.map(jnp.add, acc, g)


def _store(buf, value, slot, keep):
    return buf.at[slot].set(jnp.where(keep, value, buf[slot]))
