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
from framework.parallel.pipeline.kinds import ACT, GRAD, B
from framework.parallel.pipeline.lowering import Cells
from framework.parallel.pipeline.program import Program
from framework.parallel.pipeline.scopes import CELL, LOOP
from framework.parallel.pipeline.stage import StageFns
from framework.parallel.pipeline.tick_types import Carry, CellIn, TickState, trace_types


# --- The tick loop ----------------------------------------------------------------------

def of_phase(cells: Cells, phase: int) -> Cells:
    """The cells of tick `phase` of the loop's step: the kinds it runs somewhere."""
    return replace(cells, kinds=frozenset(cells.prog.kinds(phase)))


def _tick(cells: Cells, rank, phase: int):
    """Tick `phase` of a loop step on this rank: start sending the last tick's messages
    (overlapped), read the cell's inputs, run its cell (which writes the stash), send
    or receive and store the messages."""
    buffers = cells.prog.buffers
    cells = of_phase(cells, phase)
    runs = [cells.lower(branch) for branch in cells.prog.branches(phase)]
    travelling = [ch for ch in buffers.channels if ch.overlap and phase in ch.phases]

    def tick(carry: Carry, row: dict) -> Carry:
        # Started before the cell, done after it: nothing in the cell depends on them.
        arriving = {ch: send_overlapped(ch, carry.pending[ch.buffer]) for ch in travelling}
        kind = row["kind"][rank]
        k_read, k_stash = (jnp.maximum(row[n][rank], 0) for n in ("read", "stash"))
        msg = lambda buf: carry.recv[buf][k_read] if buf in carry.recv else cells.zeros(
            cells.types.x)
        cell = CellIn(msg(ACT), msg(GRAD), k_stash, row["mb"][rank], row["chunk"][rank],
                      row["stage"][rank], row["first"][rank], row["last"][rank], carry.held)
        douts = cells.held_zeros() if B in cells.kinds else []
        state = TickState(carry.grads, carry.loss, carry.stash, carry.saved,
                          cells.zeros(cells.types.x), cells.zeros(cells.types.x), douts)
        with jax.named_scope(CELL):  # (first, the last tick's B douts: `Role.HELD_DOUTS`)
            for run in runs:
                state = cells.dispatch(run, kind, state, cell)
        if carry.held and B in cells.kinds:
            held = (state.douts, *(varying(a, cells.manual) for a in (k_stash, kind == B)))
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

    return tick


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


def initial_carry(cells: Cells) -> Carry:
    """The tick loop's state before the first tick: every buffer the buffer plan sizes
    (the memory model measures these, `framework/analysis/memory_model.py`)."""
    n, t, buffers = cells.prog.buffers.n_slots, cells.types, cells.prog.buffers
    kept = n["stash"] + int(cells.apart)  # `apart`: a spare slot takes the writes not kept
    return Carry(recv={b: cells.zeros(t.x, n[b]) for b in (ACT, GRAD) if n[b]},
                 stash=t.packing.zeros(kept, cells.manual),
                 saved=[zeros_typed_like(jax.ShapeDtypeStruct((kept, *a.shape), a.dtype),
                                         cells.manual, jax.typeof(a).manual_axis_type.varying)
                        for a in t.saved],
                 grads=jax.tree.map(cells.zeros, cells.params),
                 loss=cells.zeros(jnp.zeros((), jnp.float32)),
                 pending={ch.buffer: cells.zeros(t.x) for ch in buffers.channels if ch.overlap},
                 held=(cells.held_zeros(), cells.zeros(jnp.zeros((), jnp.int32)),
                       cells.zeros(jnp.zeros((), bool))) if cells.split and cells.pair else ())


def loss_and_grads(prog: Program, fns: StageFns, params, inputs, targets, docs=None):
    """params: {'embed', 'head', 'chunks' [v, Lc, ...] of this rank}, varying over the
    manual axes. inputs, targets: [microbatches, mb, seq]; docs: their document masks
    or None. Returns (this rank's loss share, gradients like params)."""
    rank = jax.lax.axis_index(PIPE)
    cells = make_cells(prog, fns, params, inputs, targets, rank, docs)
    init = initial_carry(cells)
    k = prog.schedule.ticks_per_step  # the loop's step: k ticks, [steps, k, ranks]
    xs = jax.tree.map(lambda a: jnp.asarray(a).reshape(-1, k, *a.shape[1:]),
                      prog.scan_inputs())
    with jax.named_scope(LOOP):
        final, _ = jax.lax.scan(_step(cells, rank), init, xs)
    return final.loss, final.grads
