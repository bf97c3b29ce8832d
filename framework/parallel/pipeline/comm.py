"""The pipeline's communication and per-rank control flow, shared by the executors.

Executors run inside a `shard_map` that is manual over `pipe` (and `data`, `tensor`):
every rank runs the same tick loop and reads its own cell of the table. Work that only
some ranks or ticks do sits under `only_on` (a `lax.cond`, so the other ranks skip it and
its collectives), inside a named scope that the communication audit weighs by how often
the table runs it (`framework/analysis/audit.py`).

Point-to-point sends follow `framework/parallel/pipeline/buffers.py`: per channel (buffer, shift)
and tick, exactly the ranks with a message send it. A `collective-permute` has static
source-target pairs, so each distinct set of senders ("pattern") is its own branch of
a `lax.switch` on the tick's pattern index, which is the same on every rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from framework.parallel import vma
from framework.parallel.mesh import PIPE
from framework.parallel.pipeline.buffers import Channel
from framework.parallel.pipeline.scopes import channel_scope, send_scope


def only_on(scope: str, pred, fn, otherwise):
    """`fn()` where `pred` holds (this rank or tick), `otherwise()` elsewhere. A Python
    bool `pred` picks the branch at trace time."""

    def run():
        with jax.named_scope(scope):
            return fn()

    if isinstance(pred, (bool, np.bool_)):
        return run() if pred else otherwise()
    return jax.lax.cond(pred, run, otherwise)


def manual_axes(x) -> tuple:
    """The mesh axes every value the tick loop carries varies over: those `x` (the
    microbatches' token ids) varies over, and `pipe`."""
    return tuple(sorted(jax.typeof(x).manual_axis_type.varying | {PIPE}))


def varying(x, axes=(PIPE,)):
    """Marks x as (possibly) different on each device of `axes` (a shard_map type)."""
    return vma.cast(x, axes)


def zeros_typed_like(a, axes=(), also=None):
    """Zeros shaped like `a`, at least as device-varying as `a` (or `also`, for shape-only
    `a`) and over `axes`."""
    vary = set(axes) | set(jax.typeof(a).manual_axis_type.varying if also is None else also)
    return varying(jnp.zeros(a.shape, a.dtype), tuple(sorted(vary)))


def send(channel: Channel, pattern, value):
    """What this rank receives on `channel` this tick (zeros if nothing arrives): the
    senders of `pattern` (a traced index into `channel.pairs`) pass `value` on."""
    if channel.shift == 0:  # a rank's message to itself
        return value

    def permute(k):
        def branch(x):
            with jax.named_scope(send_scope(channel, k)):
                return jax.lax.ppermute(x, PIPE, list(channel.pairs[k]))
        return branch

    branches = [jnp.zeros_like] + [permute(k) for k in range(1, len(channel.pairs))]
    with jax.named_scope(channel_scope(channel)):  # (its branches weighed by pattern)
        return jax.lax.switch(pattern, branches, value)


def send_overlapped(channel: Channel, value):
    """What this rank receives on an overlapped `channel` (every pair it ever uses sends,
    unconditionally, so that the transfer can run beside the cell's compute)."""
    with jax.named_scope(send_scope(channel, 1)):
        return jax.lax.ppermute(value, PIPE, list(channel.pairs[1]))


def slots(like_shape, n: int) -> tuple:
    """Shape of a buffer of n slots: one more, the last, takes the writes not kept."""
    return (n + 1,) + tuple(like_shape)


def write_slot(buf, value, slot):
    """buf [n, ...] with buf[slot] = value [...]: a dynamic-update-slice, written in place
    (`.at[slot].set` lowers to a scatter)."""
    return jax.lax.dynamic_update_slice(buf, value[None].astype(buf.dtype),
                                        (slot,) + (0,) * value.ndim)


def store(buf, value, slot, keep):
    """buf[slot] = value where `keep`, else value goes to the spare last slot (`slots`):
    an unconditional in-place write, no read of the old slot."""
    return write_slot(buf, value, jnp.where(keep, slot, buf.shape[0] - 1))
