"""Executor for any table: runs every cell itself, backward included (1F1B, interleaved
1F1B, zero-bubble schedules; GPipe and circular tables too).

Autodiff of a forward loop keeps every microbatch's activations until the whole
backward runs. Here the tick loop carries the backward, so only the microbatches the
table keeps in flight hold memory. Each tick every rank runs the cell the table names
for it: what each kind does is in `cells.py`, how its conditional is lowered for the
compiler (in place, or apart on GPUs before jaxlib 0.11.2) in `lowering.py`, and which
conditionals a tick opens, in order, is the Program's (`Program.branches`): each kind
the tick runs somewhere, followed by the head (last stage, after F) and the embedding's
gradient (first stage, after the backward that ends in dx). The cells write the stash
in place, inside their conditionals: F its residuals, B its douts (in a conditional of
its own after B's: XLA copied a stash that one conditional both read and rewrote).
Then come the sends the buffer plan names for this tick
(`framework/parallel/pipeline/buffers.py`).

With overlapped sends (`Schedule.overlap`) the loop runs a pair of ticks per step, a
forward tick (F, W) and a backward tick (B, BW, W), and each tick starts by sending the
previous tick's messages to the other ranks (`pending`): an unconditional `ppermute`
that the cell's compute runs beside, received and stored after the cell. So the
activations travel during the backward tick and the gradients during the next forward
tick. B's douts are then stored at the start of the next tick (`Carry.held`,
`Cells.put`), so that every write of a step comes before its reads. A stash slot is one
flat buffer per dtype, so that B's output gradients can take the residuals' place
(`stash.Packing`): with a split backward a microbatch in flight holds no more than
1F1B's full residuals.

With `parallel.combined_1f1b` (`Program.fused`) a BW and the F of the next tick on the
same rank run as one cell, their layer loops as one (`Cells.combined`), so that one's
collectives run beside the other's matmuls: the loop's steps are then (backward tick,
forward tick) pairs, the table's first and last ticks run apart (`combined_loop`).

Shapes below: mb = rows of a microbatch, seq = its tokens (/tensor with sequence
parallelism), d = d_model; n = slots of a buffer (a receive buffer has one more,
the spare row that takes the writes not kept, `comm.slots`).
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp

from framework.parallel.mesh import PIPE
from framework.parallel.pipeline.comm import (manual_axes, send, send_overlapped, store,
                                              varying, zeros_typed_like)
from framework.parallel.pipeline.kinds import ACT, GRAD, IDLE, B
from framework.parallel.pipeline.lowering import Cells, head_combined, run_combined
from framework.parallel.pipeline.program import Program
from framework.parallel.pipeline.scopes import CELL, LOOP
from framework.parallel.pipeline.stage import StageFns
from framework.parallel.pipeline.tick_types import Carry, CellIn, TickState, trace_types


# --- The tick loop ----------------------------------------------------------------------

def of_phase(cells: Cells, phase: int) -> Cells:
    """The cells of tick `phase` of the loop's step: the kinds it runs somewhere."""
    return replace(cells, kinds=frozenset(cells.prog.kinds(phase)))


def _travelling(cells: Cells, phase: int) -> list:
    """The overlapped channels whose messages travel during tick `phase` of a step."""
    return [ch for ch in cells.prog.buffers.channels if ch.overlap and phase in ch.phases]


def _read(cells: Cells, carry: Carry, row: dict, rank):
    """This rank's cell this tick: (its kind, its inputs from the receive slots)."""
    kind = row["kind"][rank]
    k_read, k_stash = (jnp.maximum(row[n][rank], 0) for n in ("read", "stash"))
    msg = lambda buf: carry.recv[buf][k_read] if buf in carry.recv else cells.zeros(
        cells.types.x)
    return kind, CellIn(msg(ACT), msg(GRAD), k_stash, row["mb"][rank], row["chunk"][rank],
                        row["stage"][rank], row["first"][rank], row["last"][rank], carry.held)


def _state(cells: Cells, carry: Carry) -> TickState:
    douts = cells.held_zeros() if B in cells.kinds else []
    return TickState(carry.grads, carry.loss, carry.stash, carry.saved,
                     cells.zeros(cells.types.x), cells.zeros(cells.types.x), douts)


def _dispatch(cells: Cells, runs: list, kind, state: TickState, cell: CellIn) -> TickState:
    with jax.named_scope(CELL):  # (first, the last tick's B douts: `Role.HELD_DOUTS`)
        for run in runs:
            state = cells.dispatch(run, kind, state, cell)
    return state


def _finish(cells: Cells, carry: Carry, state: TickState, row: dict, rank, arriving: dict,
            kind, cell: CellIn) -> Carry:
    """The tick's end: send or receive and store its messages, keep what it made."""
    buffers = cells.prog.buffers
    if carry.held and B in cells.kinds:
        held = (state.douts, *(varying(a, cells.manual) for a in (cell.slot, kind == B)))
    else:
        held = carry.held
    made = {ACT: state.act, GRAD: state.grad}
    recv = dict(carry.recv)
    for ch, arrive, pattern in zip(buffers.channels, row["arrive"], row["pattern"]):
        if ch.overlap and ch not in arriving:
            continue
        got = arriving[ch] if ch.overlap else send(ch, pattern, made[ch.buffer])
        recv[ch.buffer] = store(recv[ch.buffer], got, arrive[rank], arrive[rank] >= 0)
    pending = {buf: made[buf] for buf in carry.pending}
    return Carry(recv, state.stash, state.saved, state.grads, state.loss, pending, held)


def _tick(cells: Cells, rank, phase: int, first: bool = False):
    """Tick `phase` of a loop step on this rank: start sending the last tick's messages
    (overlapped; not in the `first` tick of all, run apart, where there are none),
    read the cell's inputs, run its cell (which writes the stash), send or receive and
    store the messages."""
    cells = of_phase(cells, phase)
    runs = [cells.lower(branch) for branch in cells.prog.branches(phase)]

    def tick(carry: Carry, row: dict) -> Carry:
        # Started before the cell, done after it: nothing in the cell depends on them.
        arriving = {ch: send_overlapped(ch, carry.pending[ch.buffer])
                    for ch in ([] if first else _travelling(cells, phase))}
        kind, cell = _read(cells, carry, row, rank)
        state = _dispatch(cells, runs, kind, _state(cells, carry), cell)
        return _finish(cells, carry, state, row, rank, arriving, kind, cell)

    return tick


def _combined_step(cells: Cells, rank):
    """A step of the combined loop (`parallel.combined_1f1b`): a backward tick, then the
    next forward tick; where the rank's BW and F run combined (`Program.fused`), as one
    cell between the two (after the backward tick's messages arrived, which its F
    reads), their layer loops as one (`Cells.combined`). The forward tick's messages
    (BW's dx among them) start after the combined cell; the other ranks' cells run as
    in `_tick`."""
    back, fwd = of_phase(cells, 1), of_phase(cells, 0)
    runs_back = [back.lower(b) for b in cells.prog.branches(1)]
    runs_fwd = [fwd.lower(b) for b in cells.prog.branches(0)]

    def step(carry: Carry, rows: dict):
        row_b, row_f = (jax.tree.map(lambda a: a[i], rows) for i in (0, 1))
        fused = row_b["fused"][rank]
        alone = lambda kind: jnp.where(fused, IDLE, kind)  # the cells not combined
        arriving = {ch: send_overlapped(ch, carry.pending[ch.buffer])
                    for ch in _travelling(cells, 1)}
        kind, cell_b = _read(back, carry, row_b, rank)
        state = _dispatch(back, runs_back, alone(kind), _state(back, carry), cell_b)
        carry = _finish(back, carry, state, row_b, rank, arriving, alone(kind), cell_b)
        kind, cell_f = _read(fwd, carry, row_f, rank)
        with jax.named_scope(CELL):
            state = run_combined(fwd, fused, _state(fwd, carry), cell_f, cell_b)
            pending = {buf: jnp.where(fused, state.grad, sent) if buf == GRAD else sent
                       for buf, sent in carry.pending.items()}  # (none at pipeline 1)
            state = head_combined(fwd, fused, state._replace(grad=cells.zeros(cells.types.x)),
                                  cell_f)
        carry = carry._replace(pending=pending)
        arriving = {ch: send_overlapped(ch, carry.pending[ch.buffer])
                    for ch in _travelling(cells, 0)}
        state = _dispatch(fwd, runs_fwd, alone(kind), state, cell_f)
        return _finish(fwd, carry, state, row_f, rank, arriving, alone(kind), cell_f), None

    return step


def combined_loop(cells: Cells, rank, carry: Carry, rows: dict) -> Carry:
    """The tick loop of `parallel.combined_1f1b`: the first (forward) tick, then steps
    of (backward, forward) ticks (`_combined_step`), then the last (backward) tick; the
    messages are those of `_step`'s loop, tick for tick."""
    at = lambda i: jax.tree.map(lambda a: jnp.asarray(a)[i], rows)
    middle = jax.tree.map(lambda a: jnp.asarray(a)[1:-1].reshape(-1, 2, *a.shape[1:]), rows)
    carry = _tick(cells, rank, 0, first=True)(carry, at(0))
    carry, _ = jax.lax.scan(_combined_step(cells, rank), carry, middle)
    return _tick(cells, rank, 1)(carry, at(-1))


def _step(cells: Cells, rank):
    """The loop's body: one tick, or a (forward, backward) pair when sends overlap."""
    ticks = [_tick(cells, rank, phase) for phase in range(cells.prog.schedule.ticks_per_step)]

    def step(carry: Carry, rows: dict):
        for phase, tick in enumerate(ticks):
            carry = tick(carry, jax.tree.map(lambda a: a[phase], rows))
        return carry, None

    return step


def make_cells(prog: Program, fns: StageFns, params, inputs, targets, rank,
               docs=None) -> Cells:
    """The branches of this rank's ticks (`rank`: its pipeline rank, traced), with the
    types of what they keep."""
    split = prog.schedule.split_backward
    if split and fns.split is None:
        raise ValueError(f"schedule {prog.schedule.name} splits the backward: "
                         f"StageFns.split is needed")
    recompute = split and fns.split.recompute
    types = trace_types(fns, prog, params, inputs, recompute, rank, docs)
    return Cells(fns, prog, params, inputs, targets, types, manual_axes(inputs), split,
                 recompute, docs)


def compute_weights(fns: StageFns, params) -> tuple:
    """(the params the cells compute with, the tree their gradients accumulate like):
    the layers' matrices as their uses make them, once a step (`StageFns.weights`), the
    gradients in the stored dtype; without, the params themselves."""
    return fns.weights(params) if fns.weights else (params, params)


def initial_carry(cells: Cells, like=None) -> Carry:
    """The tick loop's state before the first tick: every buffer the buffer plan sizes
    (the memory model measures these, `framework/analysis/memory_model.py`); the
    gradients accumulate like `like` (default: the params the cells compute with)."""
    n, t, buffers = cells.prog.buffers.n_slots, cells.types, cells.prog.buffers
    kept = n["stash"] + int(cells.apart)  # `apart`: a spare slot takes the writes not kept
    return Carry(recv={b: cells.zeros(t.x, n[b]) for b in (ACT, GRAD) if n[b]},
                 stash=t.packing.zeros(kept, cells.manual),
                 saved=[zeros_typed_like(jax.ShapeDtypeStruct((kept, *a.shape), a.dtype),
                                         cells.manual, jax.typeof(a).manual_axis_type.varying)
                        for a in t.saved],
                 grads=jax.tree.map(cells.zeros, cells.params if like is None else like),
                 loss=cells.zeros(jnp.zeros((), jnp.float32)),
                 pending={ch.buffer: cells.zeros(t.x) for ch in buffers.channels if ch.overlap},
                 held=(cells.held_zeros(), cells.zeros(jnp.zeros((), jnp.int32)),
                       cells.zeros(jnp.zeros((), bool))) if cells.split and cells.pair else ())


def loss_and_grads(prog: Program, fns: StageFns, params, inputs, targets, docs=None):
    """params: {'embed', 'head', 'chunks' [v, Lc, ...] of this rank}, varying over the
    manual axes, as stored (`compute_weights` makes what the cells compute with).
    inputs, targets: [microbatches, mb, seq]; docs: their document masks or None.
    Returns (this rank's loss share, gradients like params)."""
    rank = jax.lax.axis_index(PIPE)
    params, like = compute_weights(fns, params)
    cells = make_cells(prog, fns, params, inputs, targets, rank, docs)
    init = initial_carry(cells, like)
    k = prog.schedule.ticks_per_step  # the loop's step: k ticks, [steps, k, ranks]
    xs = jax.tree.map(lambda a: jnp.asarray(a).reshape(-1, k, *a.shape[1:]),
                      prog.scan_inputs())
    with jax.named_scope(LOOP):
        if prog.combined:
            final = combined_loop(cells, rank, init, prog.scan_inputs())
        else:
            final, _ = jax.lax.scan(_step(cells, rank), init, xs)
    return final.loss, final.grads
