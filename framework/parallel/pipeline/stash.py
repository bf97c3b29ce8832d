"""The tick executor's stash: what each microbatch in flight keeps for its backward.

A stash slot holds, one at a time, several lists of arrays of different shapes (a
chunk's VJP residuals, then with a split backward the weight ops' output gradients
that B writes over the dead residuals), so it is one buffer per dtype and varying type
rather than one per array (`Packing`): a microbatch in flight then holds no more than
the larger of the lists.

Residuals kept in place (`scan_into`, `scan_from`): F's layer loop takes one layer's
VJP at a time and writes its residuals straight into that layer's rows of the slot
(`Piece.at`); the backward's reverse loop reads each layer's rows back and rebuilds
that layer's VJP. Nothing is stacked per chunk and then copied into the slot, or sliced
out of it whole and then sliced again per layer: each residual byte is written once
and read once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from framework.parallel.pipeline.comm import zeros_typed_like
from framework.parallel.pipeline.stage import join_vjp, split_vjp

LANE = 128  # a stash row is [elements / LANE, LANE]: see `Packing`


class Like(NamedTuple):
    """An array's type, kept out of the trace that made it: shape, dtype, and the mesh
    axes it varies over (a stash buffer's key, `_key`)."""

    shape: tuple
    dtype: object
    vary: tuple

    @staticmethod
    def of(a) -> "Like":
        return Like(tuple(a.shape), a.dtype, tuple(sorted(jax.typeof(a).manual_axis_type.varying)))


def _key(a) -> str:
    """Arrays of one key share a buffer: same dtype and same varying mesh axes."""
    vary = a.vary if isinstance(a, Like) else sorted(jax.typeof(a).manual_axis_type.varying)
    return f"{jnp.dtype(a.dtype)}|{','.join(vary)}"


def _lanes(a) -> int:
    """Rows of LANE elements that array `a` takes in a stash row (its tail padded)."""
    return -(-math.prod(a.shape) // LANE)


@dataclass(frozen=True)
class Packing:
    """Several lists of arrays stored, one list at a time, in one buffer per key (dtype
    and device-varying type, which the VJPs need back exactly): [slots, rows, LANE],
    each array from a row of its own. Not [slots, elements]: TPUs tile an array's last
    two dimensions, so a small slot count there is padded (9 slots of a Llama-3-8B stage
    took 16 slots' memory, 16 GiB instead of 9, on the TPU compiler)."""

    rows: dict  # key -> rows of LANE elements

    @staticmethod
    def of(*likes) -> "Packing":
        rows: dict = {}
        for like in likes:
            per: dict = {}
            for a in like:
                per[_key(a)] = per.get(_key(a), 0) + _lanes(a)
            for key, n in per.items():
                rows[key] = max(rows.get(key, 0), n)
        return Packing(rows)

    def zeros(self, n: int, manual: tuple = ()) -> dict:
        """{key: [n, rows, LANE]}, varying over the key's axes and `manual` (the slot a
        cell writes varies over `pipe`, and so does the buffer it writes)."""
        def one(key, rows):
            dtype, axes = key.split("|")
            return zeros_typed_like(jax.ShapeDtypeStruct((n, rows, LANE), dtype), manual,
                                    axes.split(",") if axes else ())
        return {key: one(key, rows) for key, rows in self.rows.items()}

    def store(self, stash: dict, leaves, slot, like, at: dict | None = None) -> dict:
        """Writes `leaves` into slot `slot` of the stash, each at its row: no copy into
        one array first. `like`: their types as traced, which name their buffers (a
        leaf may vary over more axes after a conditional). `at`: the first row per key
        (traced, maybe), else 0."""
        at = dict(at) if at is not None else dict.fromkeys(self.rows, 0)
        stash = dict(stash)
        for a, t in zip(leaves, like, strict=True):
            key, n = _key(t), _lanes(a)
            flat = a.reshape(-1)
            if flat.size % LANE:
                flat = jnp.pad(flat, (0, n * LANE - flat.size))
            stash[key] = jax.lax.dynamic_update_slice(
                stash[key], flat.reshape(1, n, LANE), (slot, at[key], 0))
            at[key] += n
        return stash

    def read(self, stash: dict, slot, like, at: dict | None = None) -> list:
        """Arrays shaped like `like`, read from slot `slot` of the stash at their rows
        from `at` (as `store`'s; only what is asked for is copied out of the slot)."""
        at = dict(at) if at is not None else dict.fromkeys(self.rows, 0)
        out = []
        for a in like:
            key, n = _key(a), _lanes(a)
            rows = jax.lax.dynamic_slice(stash[key], (slot, at[key], 0), (1, n, LANE))
            out.append(rows.reshape(-1)[:math.prod(a.shape)].reshape(a.shape))
            at[key] += n
        return out




# --- Residuals kept in place, one layer at a time --------------------------------------

class Piece(NamedTuple):
    """A run of a chunk's layers [lo, hi) (a BW part, or the whole chunk) whose residuals
    sit in a stash slot one layer after another: layer lo + l's at rows `at(l)`, one
    layer's leaves typed `like`, its VJP rebuilt by `join_vjp(..., vjp_def, param_slot,
    that layer's weights)`."""

    lo: int
    hi: int
    like: tuple  # Like, ...: one layer's residual leaves
    vjp_def: object
    param_slot: list
    start: dict  # key -> the slot's row where layer lo's residuals start

    def per_layer(self) -> dict:
        """key -> rows of LANE elements one layer's residuals take."""
        rows: dict = {}
        for a in self.like:
            rows[_key(a)] = rows.get(_key(a), 0) + _lanes(a)
        return rows

    def at(self, l) -> dict:
        """key -> the first row of the piece's layer l (traced)."""
        return {k: self.start.get(k, 0) + l * n for k, n in self.per_layer().items()}


def layer_vjps(on_layer, carry, split: bool = False):
    """A `scan` for `framework.model.stack.scan_layers` that runs each layer under its
    own `jax.vjp`: `on_layer(carry, residuals, vjp_def, param_slot, l, saved) -> carry`
    gets layer l's residuals (its weights left out, `split_vjp`). Returns (scan, result),
    result["carry"] the carry after the last layer once the scan has run. `split`
    (zero-bubble's B and W, `SplitBackward.layers`): a layer is one(h, (params, taps),
    s) -> (h', saved), its VJP is of h and the taps (the weights constants to it), and
    `saved` are its weight ops' inputs (else None)."""
    result = {}

    def scan(one, h, layers, scanned):  # one(h, params, scanned_l) -> h'; h [mb, seq, d]
        def body(hc, xs):
            h, c = hc
            params, s, l = xs
            if split:
                params, taps = params
                h, vjp_fn, saved = jax.vjp(lambda h, t: one(h, (params, t), s), h, taps,
                                           has_aux=True)
            else:
                h, vjp_fn = jax.vjp(lambda p, h: one(h, p, s), params, h)
                saved = None
            return (h, on_layer(c, *split_vjp(vjp_fn, params), l, saved)), None

        n = jax.tree.leaves(layers)[0].shape[0]
        (h, result["carry"]), _ = jax.lax.scan(body, (h, carry), (layers, scanned,
                                                                  jnp.arange(n)))
        return h

    return scan, result


def probe(layers_fn, w, x, split: bool = False):
    """One layer's residual types and VJP structure of `layers_fn(w, x, scan=...)` (for
    the types only: the trace is dead code): (y, like, vjp_def, param_slot)."""
    found = []

    def record(c, acts, vjp_def, param_slot, l, saved):
        found[:] = [tuple(Like.of(a) for a in acts), vjp_def, param_slot]
        return c

    scan, _ = layer_vjps(record, (), split)
    y = layers_fn(w, x, scan=scan)
    return (y, *found)


def scan_into(packing: Packing, stash: dict, slot, piece: Piece, saved: list | None = None):
    """A `scan` that writes each layer's residuals into its rows of slot `slot` of the
    stash as it goes (F). Returns (scan, result): result["carry"] the stash after it.
    `saved` (a split backward keeping the weight ops' inputs, `layer_vjps`): their
    buffers, each [slots, layers, ...]; layer l's inputs go into [slot, l], and the
    carry is (stash, saved)."""
    def write(stash, acts, vjp_def, param_slot, l, kept):
        return packing.store(stash, acts, slot, piece.like, piece.at(l))

    def write_both(carry, acts, vjp_def, param_slot, l, kept):
        stash, bufs = carry
        bufs = [jax.lax.dynamic_update_slice(
            buf, a[None, None].astype(buf.dtype), (slot, l) + (0,) * a.ndim)
            for buf, a in zip(bufs, jax.tree.leaves(kept), strict=True)]
        return write(stash, acts, vjp_def, param_slot, l, kept), bufs

    if saved is None:
        return layer_vjps(write, stash)
    # the buffers' rows are the chunk's layers, l counts from the piece's first: a split
    # backward keeps its chunk as one piece (tick_types), so they are the same
    assert piece.lo == 0, f"a split backward's piece starts at layer {piece.lo}, not 0"
    return layer_vjps(write_both, (stash, list(saved)), split=True)


def scan_from(packing: Packing, stash: dict, slot, piece: Piece, w, dy, split: bool = False):
    """The backward of the piece's layers (w: their weights [hi - lo, ...]) from their
    rows of slot `slot`, top layer first: (weight gradients like w, dx); `split`
    (zero-bubble's B): (the weight ops' output gradients [hi - lo, ...], dx)."""
    def back(dh, xs):  # dh [mb, seq, d]
        params, l = xs
        acts = packing.read(stash, slot, piece.like, piece.at(l))
        vjp_fn = join_vjp(acts, piece.vjp_def, piece.param_slot, params)
        if split:  # of the input and the taps: dx, douts
            return vjp_fn(dh)
        g_p, dh = vjp_fn(dh)
        return dh, g_p

    n = jax.tree.leaves(w)[0].shape[0]
    dx, per_layer = jax.lax.scan(back, dy, (w, jnp.arange(n)), reverse=True)
    return per_layer, dx


def scan_fused(packing: Packing, stash: dict, slot, piece: Piece, back: tuple, read=None):
    """A `scan` for a combined cell (F+BW, `parallel.combined_1f1b`): F's layer loop
    (as `scan_into`: each layer's residuals written into its rows of slot `slot`) and
    the backward of another microbatch (as `scan_from`) in one loop, F's layer n-1-l
    beside the backward's layer l (top first), so that the compiler can run one's
    collectives (the expert all-to-alls, tensor parallelism's) beside the other's
    matmuls. back: (its weights [n, ...], dL/dy [mb, seq, d], its slot); read: the
    stash it reads (None: the one written, passed through in place). Returns (scan,
    result): result["carry"] the stash after it, ["g_w"] the backward's weight
    gradients [n, ...], ["dx"] its input's gradient."""
    w_back, dy, slot_back = back
    result = {}

    def scan(one, h, layers, scanned):  # one(h, params, scanned_l) -> h'; h [mb, seq, d]
        n = jax.tree.leaves(layers)[0].shape[0]
        at = lambda tree, l: jax.tree.map(lambda a: a[l], tree)

        def body(carry, xs):
            h, dh, stash = carry
            params_back, l = xs
            acts = packing.read(stash if read is None else read, slot_back, piece.like,
                                piece.at(l))
            g_p, dh = join_vjp(acts, piece.vjp_def, piece.param_slot, params_back)(dh)
            lf, params = n - 1 - l, at(layers, n - 1 - l)
            h, vjp_fn = jax.vjp(lambda p, h: one(h, p, at(scanned, lf)), params, h)
            stash = packing.store(stash, split_vjp(vjp_fn, params)[0], slot, piece.like,
                                  piece.at(lf))
            return (h, dh, stash), g_p

        (h, result["dx"], result["carry"]), result["g_w"] = jax.lax.scan(
            body, (h, dy, stash), (w_back, jnp.arange(n)), reverse=True)
        return h

    return scan, result
