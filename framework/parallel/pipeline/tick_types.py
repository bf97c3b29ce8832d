"""What flows through the tick executor's loop (framework/parallel/pipeline/ticks.py):
the carry, a cell's inputs and outputs, a BW cut into parts, and the types of what a
cell keeps, traced once from one forward (`trace_types`).

Shapes: mb = rows of a microbatch, seq = its tokens (/tensor with sequence
parallelism), d = d_model; n = slots of a buffer (+1: the spare row, `comm.slots`).
"""

from __future__ import annotations

from functools import partial
from contextlib import ExitStack
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from framework.parallel.pipeline.comm import varying
from framework.parallel.pipeline.program import Program
from framework.parallel.pipeline.stage import StageFns, of_microbatch, split_vjp
from framework.parallel.pipeline.stash import Packing


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
    #                   start of the next tick (`Cells.put`)


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


class TickState(NamedTuple):
    """What a tick's cells update (`ticks.py`): each kind's cell runs under its own
    two-way conditional that takes this whole state and, on the ranks not running it,
    returns it unchanged. XLA keeps a value passed through a two-way conditional in its
    buffer; an n-way `lax.switch` copied every value a branch returns unchanged (the
    gradient accumulators, twice a tick), and a slot of zeros built by the branches
    that store nothing."""

    grads: dict  # the carry's gradient accumulators
    loss: jax.Array  # f32 []
    stash: dict  # the carry's stash: F writes the residuals, B (split) the douts
    saved: list  # the carry's saved buffers: F (split) or B (recompute) writes them
    act: jax.Array  # [mb, seq, d] sent on the `act` channels (F's output), zeros if none
    grad: jax.Array  # [mb, seq, d] sent on the `grad` channels (dL/dy or dx)
    douts: list  # B (split): the weight ops' output gradients (recompute: [dy]) for W
    g_w: object = None  # `Cells.apart`: a cell's weight gradients, added after it
    fresh: object = None  # `Cells.apart`: F's residuals and kept inputs, stored after it

# --- A cell's conditional ---------------------------------------------------------------

class Run(NamedTuple):
    """`fn(state, cell)` runs on the ranks whose cell is of `kind` (and, `on` "first" /
    "last", whose stage is the first / last), as its own two-way conditional that
    returns only the fields of the state in `writes`: what it reads is an operand, not
    an output (XLA copied a stash that one conditional both read and returned)."""

    scopes: tuple  # named scopes, outermost first
    kind: int
    on: Optional[str]
    fn: Callable
    writes: tuple  # fields of TickState; "grads.chunks" etc.: that part of the gradients
    #                (only: the GPU compiler copies what a conditional passes through)
    layers: slice = slice(None)  # the chunk's layers whose gradients it makes (BWj)
    # no conditional: `writes` written on every rank, into the spare stash slot where
    # `kind` does not run (`Cells.dispatch`; B's douts apart, with synchronous sends)
    unconditional: bool = False

    def pred(self, kind, cell: CellIn):
        """Whether it runs on this rank this tick."""
        pred = kind == self.kind
        if self.on is not None:
            pred = pred & (cell.first if self.on == "first" else cell.last)
        return pred

    def __call__(self, kind, state: TickState, cell: CellIn) -> TickState:
        pred = self.pred(kind, cell)
        return cond_fields(self.scopes, pred, lambda s: self.fn(s, cell), state, self.writes)


def cond_fields(scopes: tuple, pred, fn, state: TickState, writes: tuple) -> TickState:
    """state with its fields `writes` from `fn(state)` where `pred` holds, else as they
    were: a two-way conditional that returns only those fields, inside the named
    `scopes` (nested: the communication audit weighs a scope inside another by both,
    `Program.scope_weights`). What `fn` writes is typed as varying over the manual axes
    as what it replaces (a value computed from constants alone, e.g. a window's
    positions among F's fresh residuals, is invariant: the parity search found it)."""
    def run(s):
        new, old = fields_of(fn(s), writes), fields_of(s, writes)
        return jax.tree.map(lambda a, b: varying(a, jax.typeof(b).manual_axis_type.varying),
                            new, old)

    with ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(jax.named_scope(scope))
        out = jax.lax.cond(pred, run, lambda s: fields_of(s, writes), state)
    return with_fields(state, writes, out)


def fields_of(state: TickState, fields: tuple) -> tuple:
    """The values of `fields` of the state; "grads.x": the gradients' part x only."""
    return tuple(state.grads[f[6:]] if f.startswith("grads.") else getattr(state, f)
                 for f in fields)


def with_fields(state: TickState, fields: tuple, values: tuple) -> TickState:
    """The state with `fields` (as `_fields` names them) set to `values`."""
    parts = {f[6:]: v for f, v in zip(fields, values) if f.startswith("grads.")}
    rest = {f: v for f, v in zip(fields, values) if not f.startswith("grads.")}
    return state._replace(**rest, **({"grads": dict(state.grads, **parts)} if parts else {}))



class Piece(NamedTuple):
    """One part of a chunk's layers whose backward is its own cell (BWj, `table.py`):
    layers [lo, hi) of the chunk, its VJP's residuals at [start, start + n) of the
    stash slot's list, and how to rebuild the VJP from them (`stage.join_vjp`)."""

    lo: int
    hi: int
    start: int
    n: int
    vjp_def: object
    param_slot: list


def part_bounds(n_layers: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each part of a chunk's `n_layers` layers, bottom first, as even as
    whole layers allow."""
    edges = np.linspace(0, n_layers, parts + 1).round().astype(int)
    return [(int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:])]


def layer_slice(tree, lo: int, hi: int):
    return jax.tree.map(lambda a: a[lo:hi], tree)


def _part_real(n_real, lo: int, hi: int):
    """Uneven stages: how many of the part's layers are real (None: all)."""
    return None if n_real is None else jnp.clip(n_real - lo, 0, hi - lo)


def forward_in_parts(fns: StageFns, w, x, n_real, parts: int, docs=None, first=None):
    """The chunk's forward as its parts, bottom first: (y, residuals of every part in
    one list, the `Piece`s). `first`: the global index of the chunk's first layer."""
    residuals, pieces = [], []
    for lo, hi in part_bounds(jax.tree.leaves(w)[0].shape[0], parts):
        part = layer_slice(w, lo, hi)
        x, vjp_fn = jax.vjp(partial(fns.layers, n_real=_part_real(n_real, lo, hi), docs=docs,
                                    first=None if first is None else first + lo), part, x)
        acts, vjp_def, param_slot = split_vjp(vjp_fn, part)
        pieces.append(Piece(lo, hi, len(residuals), len(acts), vjp_def, param_slot))
        residuals += acts
    return x, residuals, pieces


class Types(NamedTuple):
    """Types of a message and of a stash slot's contents: one forward traced for its
    shapes only (dead code the compiler drops)."""

    x: jax.Array  # [mb, seq, d]
    residuals: list  # leaves of a chunk's VJP, the weights left out
    vjp_def: object  # the VJP's treedef, and which of its leaves are weights
    param_slot: list
    saved: list  # split backward: the weight ops' inputs, and their tree
    saved_def: object
    douts: list  # split backward: the weight ops' output gradients, and their tree
    dout_def: object
    packing: Packing  # the stash row holding either residuals or douts
    pieces: tuple = ()  # a BW cut into parts: each part's `Piece`, bottom first


def trace_types(fns: StageFns, prog: Program, params, inputs, recompute: bool, stage,
                docs=None) -> Types:
    """`stage`: any global stage typed like the table's (varying over `pipe`)."""
    split = prog.schedule.split_backward
    docs = of_microbatch(docs, 0)
    w0 = jax.tree.map(lambda a: a[0], params["chunks"])
    first = prog.first(stage, jax.tree.leaves(w0)[0].shape[0])
    chunk = partial(fns.layers, n_real=prog.real(stage), docs=docs, first=first)
    x = fns.embed(params["embed"], inputs[0])
    if prog.schedule.parts > 1:  # the stash holds every part's residuals, one list
        _, residuals, pieces = forward_in_parts(fns, w0, x, prog.real(stage),
                                                prog.schedule.parts, docs, first)
        none = jax.tree.structure([])
        return Types(x, residuals, None, None, [], none, [], none, Packing.of(residuals),
                     tuple(pieces))
    if recompute:  # the stash as 1F1B's; `saved` holds the incoming gradient, B to W
        vjp_fn, saved, douts_tree = jax.vjp(chunk, w0, x)[1], [x], []
    elif split:
        _, vjp_fn, saved = fns.split.forward(w0, x, n_real=prog.real(stage), docs=docs,
                                             first=first)
        douts_tree = vjp_fn(x)[1]
    else:
        vjp_fn, saved, douts_tree = jax.vjp(chunk, w0, x)[1], [], []
    residuals, vjp_def, param_slot = split_vjp(vjp_fn, w0)
    douts = jax.tree.leaves(douts_tree)
    return Types(x, residuals, vjp_def, param_slot, jax.tree.leaves(saved),
                 jax.tree.structure(saved), douts, jax.tree.structure(douts_tree),
                 Packing.of(residuals, douts))
