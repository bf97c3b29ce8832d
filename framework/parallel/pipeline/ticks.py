"""Executor for any table: runs every cell itself, backward included (1F1B, interleaved
1F1B, zero-bubble schedules; GPipe and circular tables too).

Autodiff of a forward loop keeps every microbatch's activations until the whole
backward runs. Here the tick loop carries the backward, so only the microbatches the
table keeps in flight hold memory. Each tick every rank runs the branch its cell names
(`lax.switch` over `Cells.branches()`):

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

Under rematerialisation (`SplitBackward.recompute`) the stash is 1F1B's (the layer
inputs): B pulls dy through the chunk's full VJP for dx, keeps dy (one message's size),
and W pulls it through again for the weight gradients. Memory: 1F1B's plus one message
per microbatch in flight; compute: the chunk's recomputed forward and input gradient
run twice (B and W) instead of once.

After the branch come the stash writes and the sends the buffer plan names for this
tick (`framework/parallel/pipeline/buffers.py`). A tick writes only the stash lists
whose writer it can run (`Cells.writes`): every tick when sends are synchronous (the
cells not writing send theirs to the spare slot: zeros), only the forward tick of a
pair for F's residuals when they overlap. With overlapped sends (`Schedule.overlap`)
the loop runs a pair of ticks per step, a forward tick (F, W) and a backward tick (B,
BW, W), and each tick starts by sending the previous tick's messages to the other ranks
(`pending`): an unconditional `ppermute` that the cell's compute runs beside, received
and stored after the cell. So the activations travel during the backward tick and the
gradients during the next forward tick. A stash slot is one flat buffer per
dtype, so that B's output gradients can take the residuals' place (`Packing`): with a
split backward a microbatch in flight holds no more than 1F1B's full residuals.

Shapes below: mb = rows of a microbatch, seq = its tokens (/tensor with sequence
parallelism), d = d_model; n = slots of a buffer (+1: the spare row that takes the
writes not kept, `comm.slots`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp

from framework.parallel.mesh import PIPE
from framework.parallel.pipeline.comm import (manual_axes, only_on, send, send_overlapped,
                                              slots, store, zeros_typed_like)
from framework.parallel.pipeline.program import Program
from framework.parallel.pipeline.scopes import CELL, CELL_SCOPES, LOOP, ON_FIRST, ON_LAST
from framework.parallel.pipeline.stage import StageFns, join_vjp, of_microbatch, split_vjp
from framework.parallel.pipeline.tick_types import (Carry, CellIn, CellOut, Types,
                                                    forward_in_parts, layer_slice, trace_types)
from framework.parallel.pipeline.table import ACT, BW, BW_PARTS, GRAD, B, F, W


# --- The cells --------------------------------------------------------------------------

@dataclass(frozen=True)
class Cells:
    """The branches a rank can run in a tick, over one chunk of one microbatch. Each
    takes (grads, loss, cell: CellIn, stash, saved) and returns (grads, loss, CellOut)."""

    fns: StageFns
    prog: Program
    params: dict  # {'embed', 'head', 'chunks' [v, Lc, ...]} of this rank
    inputs: jax.Array  # [microbatches, mb, seq] token ids
    targets: jax.Array  # [microbatches, mb, seq]
    types: Types
    manual: tuple  # mesh axes every carried value varies over
    split: bool  # the backward is split into B and W cells
    recompute: bool = False  # ... each pulling dy through the full VJP (SplitBackward)
    docs: object = None  # the microbatches' document masks (leaves [microbatches, ...])
    kinds: frozenset = frozenset()  # the cell kinds this tick of the loop's step runs

    def writes(self) -> tuple[bool, bool, bool]:
        """Which of the stash's lists this tick writes after the cell: (residuals, douts,
        saved), each only where its writer runs this tick. With overlapped sends a step's
        backward tick runs no F: no slot's worth of zeros is built and stored there."""
        split_w = self.split and not self.recompute
        return (F in self.kinds, split_w and B in self.kinds, self.saved_writer in self.kinds)

    @property
    def saved_writer(self) -> int:
        """The cell kind that writes the saved buffers: B under recompute (dy), else F."""
        return B if self.recompute else F

    def zeros(self, like, n=None):
        """Zeros like `like` (n slots of it), varying at least over `manual`."""
        shape = like.shape if n is None else slots(like.shape, n)
        return zeros_typed_like(jax.ShapeDtypeStruct(shape, like.dtype), self.manual,
                                jax.typeof(like).manual_axis_type.varying)

    def weights(self, chunk):
        """This rank's chunk `chunk` [Lc, ...]; one chunk: a static index."""
        v = jax.tree.leaves(self.params["chunks"])[0].shape[0]
        return jax.tree.map(lambda a: a[0] if v == 1 else a[chunk], self.params["chunks"])

    def out(self, act=None, grad=None, residuals=None, douts=None, saved=None) -> CellOut:
        """The cell's outputs; zeros for what it does not make, nothing for the lists
        this tick does not write (`writes`)."""
        t = self.types
        lists = [(residuals, t.residuals), (douts, t.douts), (saved, t.saved)]
        lists = [(made if made is not None else [self.zeros(a) for a in likes]) if written
                 else [] for (made, likes), written in zip(lists, self.writes())]
        return CellOut(self.zeros(t.x) if act is None else act,
                       self.zeros(t.x) if grad is None else grad, *lists)

    def add_chunk(self, grads, chunk, update, layers=slice(None)):
        """grads of chunk `chunk` (its `layers`, a static slice) += update."""
        v = jax.tree.leaves(grads["chunks"])[0].shape[0]
        return dict(grads, chunks=jax.tree.map(
            lambda a, u: a.at[0, layers].add(u) if v == 1 else a.at[chunk, layers].add(u),
            grads["chunks"], update))

    def idle(self, grads, loss, cell: CellIn, stash, saved):
        return grads, loss, self.out()

    def forward(self, grads, loss, cell: CellIn, stash, saved):
        fns, p = self.fns, self.params
        x = only_on(ON_FIRST, cell.first, lambda: fns.embed(p["embed"], self.inputs[cell.mb]),
                    lambda: cell.x)
        w, docs = self.weights(cell.chunk), of_microbatch(self.docs, cell.mb)
        first = self.prog.first(cell.stage, jax.tree.leaves(w)[0].shape[0])
        if self.types.pieces:  # a BW cut into parts: one VJP per part
            y, residuals, _ = forward_in_parts(fns, w, x, self.prog.real(cell.stage),
                                               len(self.types.pieces), docs, first)
            kept = None
        elif self.split and not self.recompute:
            y, vjp_fn, kept = fns.split.forward(w, x, n_real=self.prog.real(cell.stage),
                                                docs=docs, first=first)
            kept, residuals = jax.tree.leaves(kept), split_vjp(vjp_fn, w)[0]
        else:  # (recompute: B writes the saved buffer, F leaves zeros)
            chunk = partial(fns.layers, n_real=self.prog.real(cell.stage), docs=docs,
                            first=first)
            (y, vjp_fn), kept = jax.vjp(chunk, w, x), None
            residuals = split_vjp(vjp_fn, w)[0]

        def head():  # last stage: this microbatch's loss and dL/dy for its backward
            value, (g_head, g_embed, dy) = jax.value_and_grad(
                fns.head_loss, argnums=(0, 1, 2))(p["head"], p["embed"], y,
                                                  self.targets[cell.mb])
            return (dict(grads, head=_add(grads["head"], g_head),
                         embed=_add(grads["embed"], g_embed)), loss + value, dy)

        grads, loss, dy = only_on(ON_LAST, cell.last, head,
                                  lambda: (grads, loss, self.zeros(self.types.x)))
        return grads, loss, self.out(act=y, grad=dy, residuals=residuals, saved=kept)

    def backward(self, grads, loss, cell: CellIn, stash, saved):
        """BW, or B when the backward is split (its weight half comes later, in W)."""
        t, w = self.types, self.weights(cell.chunk)
        vjp_fn = join_vjp(t.packing.read(stash, cell.slot, t.residuals), t.vjp_def,
                          t.param_slot, w)
        douts = kept = None
        if self.recompute:  # B: dx only (XLA drops the weight half); dy kept for W
            dx, kept = vjp_fn(cell.dy)[1], [cell.dy]
        elif self.split:  # B: the gradients of the input and of the matmul outputs
            dx, douts = vjp_fn(cell.dy)
            douts = jax.tree.leaves(douts)
        else:  # BW: the gradients of the input and of the weights
            g_w, dx = vjp_fn(cell.dy)
            grads = self.add_chunk(grads, cell.chunk, g_w)
        return self.embed_grad(grads, cell, dx), loss, self.out(grad=dx, douts=douts,
                                                                  saved=kept)

    def embed_grad(self, grads, cell: CellIn, dx):
        """The first stage's backward ends in the embedding's: its gradient from dx."""
        embed = self.params["embed"]
        g_embed = only_on(ON_FIRST, cell.first, lambda: jax.vjp(
            lambda e: self.fns.embed(e, self.inputs[cell.mb]), embed)[1](dx)[0],
                          lambda: jax.tree.map(jnp.zeros_like, embed))
        return dict(grads, embed=_add(grads["embed"], g_embed))

    def backward_part(self, j: int):
        """The BWj branch: the fused backward of part j of the chunk's layers (bottom
        first), from that part's residuals in the stash slot; BW0 sends dx on, the
        others pass the gradient down to the part below (a message to itself)."""
        piece = self.types.pieces[j]

        def run(grads, loss, cell: CellIn, stash, saved):
            w = layer_slice(self.weights(cell.chunk), piece.lo, piece.hi)
            acts = self.types.packing.read(stash, cell.slot, self.types.residuals)
            vjp_fn = join_vjp(acts[piece.start:piece.start + piece.n], piece.vjp_def,
                              piece.param_slot, w)
            g_w, dx = vjp_fn(cell.dy)
            grads = self.add_chunk(grads, cell.chunk, g_w, slice(piece.lo, piece.hi))
            if j == 0:
                grads = self.embed_grad(grads, cell, dx)
            return grads, loss, self.out(grad=dx)

        return run

    def weight(self, grads, loss, cell: CellIn, stash, saved):
        t = self.types
        if self.recompute:  # the full VJP again, for the weights only (dx is dropped)
            vjp_fn = join_vjp(t.packing.read(stash, cell.slot, t.residuals), t.vjp_def,
                              t.param_slot, self.weights(cell.chunk))
            g_w = vjp_fn(saved[0][cell.slot])[0]
            return self.add_chunk(grads, cell.chunk, g_w), loss, self.out()
        kept = jax.tree.unflatten(t.saved_def, [buf[cell.slot] for buf in saved])
        douts = jax.tree.unflatten(t.dout_def, t.packing.read(stash, cell.slot, t.douts))
        g_w = self.fns.split.weight_grads(self.weights(cell.chunk), kept, douts)
        return self.add_chunk(grads, cell.chunk, g_w), loss, self.out()

    def branches(self) -> list:
        """Indexed by cell kind; the kinds not in `self.kinds` (this tick of the loop
        never runs them) are idle, never traced."""
        kinds = self.kinds
        def scoped(kind, fn):
            def run(*args):
                with jax.named_scope(CELL_SCOPES[kind]):
                    return fn(*args)
            return run if kind in kinds else self.idle

        if self.split:
            return [self.idle, scoped(F, self.forward), scoped(B, self.backward),
                    scoped(W, self.weight), self.idle]
        if self.types.pieces:  # kinds BW0, BW1, ... after the first five
            return [self.idle, scoped(F, self.forward), self.idle, self.idle, self.idle] + [
                scoped(kind, self.backward_part(j))
                for j, kind in enumerate(BW_PARTS[:len(self.types.pieces)])]
        return [self.idle, scoped(F, self.forward), self.idle, self.idle,
                scoped(BW, self.backward)]


def _add(tree, update):
    return jax.tree.map(jnp.add, tree, update)


# --- The tick loop ----------------------------------------------------------------------

def of_phase(cells: Cells, phase: int) -> Cells:
    """The cells of tick `phase` of the loop's step: the kinds it runs somewhere."""
    return replace(cells, kinds=frozenset(cells.prog.kinds(phase)))


def _tick(cells: Cells, rank, phase: int):
    """Tick `phase` of a loop step on this rank: start sending the last tick's messages
    (overlapped), read the cell's inputs, run its branch, write the stash, send or
    receive and store the messages."""
    buffers = cells.prog.buffers
    cells = of_phase(cells, phase)
    branches, packing = cells.branches(), cells.types.packing
    residuals, douts, saved_by = cells.writes()
    travelling = [ch for ch in buffers.channels if ch.overlap and phase in ch.phases]

    def tick(carry: Carry, row: dict) -> Carry:
        # Started before the cell, done after it: nothing in the cell depends on them.
        arriving = {ch: send_overlapped(ch, carry.pending[ch.buffer]) for ch in travelling}
        kind = row["kind"][rank]
        k_read, k_stash = (jnp.maximum(row[n][rank], 0) for n in ("read", "stash"))
        msg = lambda buf: carry.recv[buf][k_read] if buf in carry.recv else cells.zeros(
            cells.types.x)
        cell = CellIn(msg(ACT), msg(GRAD), k_stash, row["mb"][rank], row["chunk"][rank],
                      row["stage"][rank], row["first"][rank], row["last"][rank])
        with jax.named_scope(CELL):
            grads, loss, out = jax.lax.switch(kind, branches, carry.grads, carry.loss, cell,
                                              carry.stash, carry.saved)
        stash, saved = carry.stash, carry.saved
        if residuals:
            stash = packing.store(stash, out.residuals, k_stash, kind == F)
        if douts:
            stash = packing.store(stash, out.douts, k_stash, kind == B)
        if saved_by:
            written = kind == cells.saved_writer
            saved = [store(buf, e, k_stash, written) for buf, e in zip(saved, out.saved)]
        made = {ACT: out.act, GRAD: out.grad}
        recv = dict(carry.recv)
        for ch, arrive, pattern in zip(buffers.channels, row["arrive"], row["pattern"]):
            if ch.overlap and ch not in arriving:
                continue
            got = arriving[ch] if ch.overlap else send(ch, pattern, made[ch.buffer])
            recv[ch.buffer] = store(recv[ch.buffer], got, arrive[rank], arrive[rank] >= 0)
        pending = {buf: made[buf] for buf in carry.pending}
        return Carry(recv, stash, saved, grads, loss, pending)

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
    return Carry(recv={b: cells.zeros(t.x, n[b]) for b in (ACT, GRAD) if n[b]},
                 stash=t.packing.zeros(n["stash"]),
                 saved=[cells.zeros(a, n["stash"]) for a in t.saved],
                 grads=jax.tree.map(cells.zeros, cells.params),
                 loss=cells.zeros(jnp.zeros((), jnp.float32)),
                 pending={ch.buffer: cells.zeros(t.x) for ch in buffers.channels if ch.overlap})


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
