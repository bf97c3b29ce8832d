"""What flows through the tick executor's loop (framework/parallel/pipeline/ticks.py):
the carry, a cell's inputs and outputs (and, typed, the fields of its state a branch
writes), a BW cut into parts, and the types of what a cell keeps, traced once from one
forward (`trace_types`).

Shapes: mb = rows of a microbatch, seq = its tokens (/tensor with sequence
parallelism), d = d_model; n = slots of a buffer (+1: the spare row, `comm.slots`).
"""

from __future__ import annotations

import enum
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from framework.parallel.pipeline.program import Program
from framework.parallel.pipeline.stage import StageFns, of_microbatch
from framework.parallel.pipeline.stash import Like, Packing, Piece, probe


# --- What flows through a tick --------------------------------------------------------

class Carry(NamedTuple):
    """The tick loop's state on one device (all varying over the manual mesh axes)."""

    recv: dict  # {"act", "grad"}: [n + 1, mb, seq, d] messages waiting to be read
    stash: dict  # {dtype|axes: [n + 1, rows, LANE]}: each in-flight microbatch's slot
    saved: list  # per weight op: [n + 1, mb, seq, in] its inputs (split backward only;
    #              recompute: one [n + 1, mb, seq, d], the incoming gradient, B to W)
    grads: dict  # like the params: {'embed', 'head', 'chunks' [v, Lc, ...]}
    loss: jax.Array  # f32 []: this rank's loss share so far
    pending: dict  # overlapped sends: {"act", "grad"}: [mb, seq, d] the last tick's
    #                messages, sent to the other ranks during this tick ({} if synchronous)
    held: tuple = ()  # a pair of ticks a step, split backward: (B's douts (recompute:
    #                   [dy]), its stash slot, whether this rank ran B), stored at the
    #                   start of the next tick (`Role.HELD_DOUTS`, `Cells.put`)


class CellIn(NamedTuple):
    """What the cell of this rank reads this tick (one slot each, not the buffers)."""

    x: jax.Array  # [mb, seq, d] the `act` message (F), zeros if none
    dy: jax.Array  # [mb, seq, d] the `grad` message (B, BW), zeros if none
    slot: jax.Array  # int: the microbatch's stash slot
    mb: jax.Array  # int: the microbatch
    chunk: jax.Array  # int: this rank's layer chunk
    stage: jax.Array  # int: its global stage (uneven stages: how many layers are real)
    first: jax.Array  # bool: global stage 0 (embeds its input)
    last: jax.Array  # bool: the last global stage (head + loss)
    held: tuple = ()  # the carry's `held`: the last tick's B douts, their slot, whether B ran


class TickState(NamedTuple):
    """What a tick's cells update (`cells.py`): each kind's cell runs under its own
    two-way conditional that takes this whole state and, on the ranks not running it,
    returns it unchanged (`lowering.py`). XLA keeps a value passed through a two-way
    conditional in its buffer; an n-way `lax.switch` copied every value a branch returns
    unchanged (the gradient accumulators, twice a tick), and a slot of zeros built by
    the branches that store nothing."""

    grads: dict  # the carry's gradient accumulators
    loss: jax.Array  # f32 []
    stash: dict  # the carry's stash: F writes the residuals, B (split) the douts
    saved: list  # the carry's saved buffers: F (split) or B (recompute) writes them
    act: jax.Array  # [mb, seq, d] sent on the `act` channels (F's output), zeros if none
    grad: jax.Array  # [mb, seq, d] sent on the `grad` channels (dL/dy or dx)
    douts: list  # B (split): the weight ops' output gradients (recompute: [dy]) for W
    g_w: object = None  # a cell's weight gradients [Lc or its part's layers, ...], to add
    fresh: object = None  # F's {"residuals", "kept"} (its VJP's, the weight ops' inputs)
    #                       for its stash slot: written in the branch, or after it apart


class Field(enum.Enum):
    """A field of `TickState` that a branch writes (`lowering.Run.writes`); (field, the
    entry of the gradients' dict it is, or None)."""

    STASH = ("stash", None)
    SAVED = ("saved", None)
    ACT = ("act", None)
    GRAD = ("grad", None)
    DOUTS = ("douts", None)
    LOSS = ("loss", None)
    G_W = ("g_w", None)
    FRESH = ("fresh", None)
    GRADS_CHUNKS = ("grads", "chunks")
    GRADS_HEAD = ("grads", "head")
    GRADS_EMBED = ("grads", "embed")


def fields_of(state: TickState, fields: tuple) -> tuple:
    """The values of `fields` (`Field`s) of the state."""
    return tuple(getattr(state, f.value[0]) if f.value[1] is None else
                 getattr(state, f.value[0])[f.value[1]] for f in fields)


def with_fields(state: TickState, fields: tuple, values: tuple) -> TickState:
    """The state with `fields` (`Field`s) set to `values`."""
    grads = {f.value[1]: v for f, v in zip(fields, values) if f.value[1] is not None}
    rest = {f.value[0]: v for f, v in zip(fields, values) if f.value[1] is None}
    return state._replace(**rest, **({"grads": dict(state.grads, **grads)} if grads else {}))


# --- A BW cut into parts, and the types of what a cell keeps -------------------------

def part_bounds(n_layers: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each part of a chunk's `n_layers` layers, bottom first, as even as
    whole layers allow."""
    edges = np.linspace(0, n_layers, parts + 1).round().astype(int)
    return [(int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:])]


def layer_slice(tree, lo: int, hi: int):
    return jax.tree.map(lambda a: a[lo:hi], tree)


def part_real(n_real, lo: int, hi: int, parts: int):
    """Uneven stages: how many of a part's layers are real (None: all; one part: n_real)."""
    return n_real if n_real is None or parts == 1 else jnp.clip(n_real - lo, 0, hi - lo)


def layers_of(fns: StageFns, n_real, parts: int, docs, first, lo: int, hi: int,
              split: bool = False):
    """`fns.layers` of the chunk's layers [lo, hi): (weights [hi - lo, ...], x, scan);
    `split`: the split backward's (`SplitBackward.layers`: the VJPs of the input and
    the weight ops' outputs, the weight ops' inputs kept)."""
    return partial(fns.split.layers if split else fns.layers,
                   n_real=part_real(n_real, lo, hi, parts), docs=docs,
                   first=None if first is None else first + lo)


def trace_pieces(fns: StageFns, w, x, n_real, parts: int, docs=None, first=None,
                 split: bool = False) -> tuple:
    """The `Piece`s of a chunk's layers cut into `parts` (bottom first), each layer's
    residuals after the last's in the stash slot (traced for their types only)."""
    rows: dict = {}
    pieces = []
    for lo, hi in part_bounds(jax.tree.leaves(w)[0].shape[0], parts):
        run = layers_of(fns, n_real, parts, docs, first, lo, hi, split)
        x, like, vjp_def, param_slot = probe(run, layer_slice(w, lo, hi), x, split)
        piece = Piece(lo, hi, like, vjp_def, param_slot, dict(rows))
        for key, n in piece.per_layer().items():
            rows[key] = rows.get(key, 0) + (hi - lo) * n
        pieces.append(piece)
    return tuple(pieces)


class Types(NamedTuple):
    """Types of a message and of a stash slot's contents: one forward traced for its
    shapes only (dead code the compiler drops)."""

    x: jax.Array  # [mb, seq, d]
    saved: list  # split backward: the weight ops' inputs [Lc, ...], and their tree
    saved_def: object
    douts: list  # split backward: the weight ops' output gradients [Lc, ...], their tree
    dout_def: object
    packing: Packing  # the stash row holding either residuals (per layer) or douts
    pieces: tuple  # the chunk's `Piece`s (one per part of a BW cut into parts), bottom
    #                first: each layer's residuals in place in the stash slot


def trace_types(fns: StageFns, prog: Program, params, inputs, recompute: bool, stage,
                docs=None) -> Types:
    """`stage`: any global stage typed like the table's (varying over `pipe`)."""
    split = prog.schedule.split_backward and not recompute  # keeps the weight ops' inputs
    docs = of_microbatch(docs, 0)
    w0 = jax.tree.map(lambda a: a[0], params["chunks"])
    first = prog.first(stage, jax.tree.leaves(w0)[0].shape[0])
    x = fns.embed(params["embed"], inputs[0], docs)
    pieces = trace_pieces(fns, w0, x, prog.real(stage), 1 if split else prog.schedule.parts,
                          docs, first, split)
    rows = [Like(sh, dt, vy) for p in pieces for _ in range(p.hi - p.lo)
            for sh, dt, vy in p.like]
    if not split:  # (recompute: the incoming gradient, B to W, is saved)
        saved, none = ([x] if recompute else []), jax.tree.structure([])
        return Types(x, saved, jax.tree.structure(saved), [], none, Packing.of(rows), pieces)
    # the stacked types of what F keeps beside the stash and B writes over it (traced only)
    _, vjp_fn, saved = fns.split.forward(w0, x, n_real=prog.real(stage), docs=docs,
                                         first=first)
    douts_tree = vjp_fn(x)[1]
    douts = jax.tree.leaves(douts_tree)
    return Types(x, jax.tree.leaves(saved), jax.tree.structure(saved), douts,
                 jax.tree.structure(douts_tree), Packing.of(rows, douts), pieces)
