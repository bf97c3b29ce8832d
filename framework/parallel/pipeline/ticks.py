"""Executor for any table: runs every cell itself, backward included (1F1B, interleaved
1F1B, zero-bubble schedules; GPipe and circular tables too).

Autodiff of a forward loop keeps every microbatch's activations until the whole
backward runs. Here the tick loop carries the backward, so only the microbatches the
table keeps in flight hold memory. Each tick every rank runs the cell the table names
for it:

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

Dispatch. Each cell kind the tick runs somewhere is its own two-way `lax.cond` on
"this rank's cell is of that kind" (`Run`), in order, followed by the head (last stage,
after F) and the embedding's gradient (first stage, after the backward that ends in
dx). A conditional returns only the fields of the tick's state its cell writes
(`TickState`); the other ranks pass them through, and XLA's CPU and TPU compilers keep
a value passed through a two-way conditional in its buffer. (A single `lax.switch` over
the kinds, as before,
copied the gradient accumulators in every branch that left them alone and again after
it, and built a slot of zeros for the stash write of every cell but F: 1F1B with
synchronous sends took 1.31x GPipe's step here, 0.93x now.) The cells write the
stash in place, inside their conditionals: F its residuals, B its douts (in a
conditional of its own after B's: XLA copied a stash that one conditional both read and
rewrote). XLA's GPU compiler before jaxlib 0.11.2 copies what a conditional passes
through, so for such GPUs (`Cells.apart`, `engine.step.passes_through`) the cells hand
their weight gradients and what they keep to in-place writes after their conditionals
instead (zeros where they do not run, written to a spare stash slot / added to the
gradients). Then come the sends the
buffer plan names for this tick (`framework/parallel/pipeline/buffers.py`).

With overlapped sends (`Schedule.overlap`)
the loop runs a pair of ticks per step, a forward tick (F, W) and a backward tick (B,
BW, W), and each tick starts by sending the previous tick's messages to the other ranks
(`pending`): an unconditional `ppermute` that the cell's compute runs beside, received
and stored after the cell. So the activations travel during the backward tick and the
gradients during the next forward tick. B's douts are then stored at the start of the
next tick (`Carry.held`, `Cells.put`), so that every write of a step comes before its
reads. A stash slot is one flat buffer per
dtype, so that B's output gradients can take the residuals' place (`Packing`): with a
split backward a microbatch in flight holds no more than 1F1B's full residuals.

Shapes below: mb = rows of a microbatch, seq = its tokens (/tensor with sequence
parallelism), d = d_model; n = slots of a buffer (a receive buffer has one more,
the spare row that takes the writes not kept, `comm.slots`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp

from framework.parallel.mesh import PIPE
from framework.parallel.pipeline.comm import (manual_axes, only_on, send, send_overlapped,
                                              slots, store, varying, zeros_typed_like)
from framework.parallel.pipeline.program import Program
from framework.parallel.pipeline.kinds import ACT, BW, BW_PARTS, GRAD, KINDS, B, F, W, makes_dx
from framework.parallel.pipeline.scopes import CELL, LOOP, ON_FIRST, ON_LAST
from framework.parallel.pipeline.stage import StageFns, join_vjp, of_microbatch, split_vjp
from framework.parallel.pipeline.tick_types import (Carry, CellIn, Run, TickState, Types,
                                                    cond_fields, forward_in_parts,
                                                    layer_slice, trace_types)


# --- The cells --------------------------------------------------------------------------

@dataclass(frozen=True)
class Cells:
    """The cells a rank can run in a tick, over one chunk of one microbatch. Each takes
    (state: TickState, cell: CellIn) and returns the state it updates (`runs`)."""

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

    def zeros(self, like, n=None):
        """Zeros like `like` (n slots of it), varying at least over `manual`."""
        shape = like.shape if n is None else slots(like.shape, n)
        return zeros_typed_like(jax.ShapeDtypeStruct(shape, like.dtype), self.manual,
                                jax.typeof(like).manual_axis_type.varying)

    def weights(self, chunk):
        """This rank's chunk `chunk` [Lc, ...]; one chunk: a static index."""
        v = jax.tree.leaves(self.params["chunks"])[0].shape[0]
        return jax.tree.map(lambda a: a[0] if v == 1 else a[chunk], self.params["chunks"])

    def add_chunk(self, grads, chunk, update, layers=slice(None)):
        """grads of chunk `chunk` (its `layers`, a static slice) += update."""
        v = jax.tree.leaves(grads["chunks"])[0].shape[0]
        return dict(grads, chunks=jax.tree.map(
            lambda a, u: a.at[0, layers].add(u) if v == 1 else a.at[chunk, layers].add(u),
            grads["chunks"], update))

    @property
    def apart(self) -> bool:
        """A cell's weight gradients and what it keeps leave its conditional as fresh
        values, added / written in place after it (zeros, the spare stash slot, where
        it does not run: `dispatch`), for a compiler that would copy what a conditional
        passes through (`StageFns.pass_through`: the GPU's)."""
        return not self.fns.pass_through

    def accumulate(self, state: TickState, chunk, g_w, layers=slice(None)) -> TickState:
        """The chunk's gradients (its `layers`) += g_w; `apart`: g_w handed on."""
        if self.apart:
            return state._replace(g_w=g_w)
        return state._replace(grads=self.add_chunk(state.grads, chunk, g_w, layers))

    def forward(self, state: TickState, cell: CellIn) -> TickState:
        """F: the chunk's forward; its VJP's residuals (and, split, the weight ops'
        inputs) go to the microbatch's stash slot, its output to `act`."""
        fns, p = self.fns, self.params
        x = only_on(ON_FIRST, cell.first, lambda: fns.embed(p["embed"], self.inputs[cell.mb]),
                    lambda: cell.x)
        w, docs = self.weights(cell.chunk), of_microbatch(self.docs, cell.mb)
        first = self.prog.first(cell.stage, jax.tree.leaves(w)[0].shape[0])
        kept = []
        if self.types.pieces:  # a BW cut into parts: one VJP per part
            y, residuals, _ = forward_in_parts(fns, w, x, self.prog.real(cell.stage),
                                               len(self.types.pieces), docs, first)
        elif self.keeps_inputs:
            y, vjp_fn, kept = fns.split.forward(w, x, n_real=self.prog.real(cell.stage),
                                                docs=docs, first=first)
            residuals, kept = split_vjp(vjp_fn, w)[0], jax.tree.leaves(kept)
        else:  # (recompute: B writes the saved buffer)
            chunk = partial(fns.layers, n_real=self.prog.real(cell.stage), docs=docs,
                            first=first)
            y, vjp_fn = jax.vjp(chunk, w, x)
            residuals = split_vjp(vjp_fn, w)[0]
        if self.apart:  # stored after the conditional (`dispatch`)
            return state._replace(fresh={"residuals": residuals, "kept": kept}, act=y)
        return self.write_kept(state._replace(act=y), cell.slot, residuals, kept)

    @property
    def keeps_inputs(self) -> bool:
        """F keeps the weight ops' inputs for W (a split backward without remat)."""
        return self.split and not self.recompute

    def write_kept(self, state: TickState, slot, residuals: list, kept: list) -> TickState:
        """F's residuals into stash slot `slot`, its kept inputs into the saved buffers'."""
        saved = [buf.at[slot].set(e) for buf, e in zip(state.saved, kept)]
        t = self.types
        return state._replace(stash=t.packing.store(state.stash, residuals, slot, t.residuals),
                              saved=saved or state.saved)

    def head(self, state: TickState, cell: CellIn) -> TickState:
        """After F on the last stage: the microbatch's loss, and dL/dy for its backward."""
        fns, p, grads = self.fns, self.params, state.grads
        value, (g_head, g_embed, dy) = jax.value_and_grad(fns.head_loss, argnums=(0, 1, 2))(
            p["head"], p["embed"], state.act, self.targets[cell.mb])
        grads = dict(grads, head=_add(grads["head"], g_head), embed=_add(grads["embed"], g_embed))
        return state._replace(grads=grads, loss=state.loss + value, grad=dy)

    def backward(self, state: TickState, cell: CellIn) -> TickState:
        """BW, or B when the backward is split (its weight half comes later, in W)."""
        t, w = self.types, self.weights(cell.chunk)
        vjp_fn = join_vjp(t.packing.read(state.stash, cell.slot, t.residuals), t.vjp_def,
                          t.param_slot, w)
        if self.recompute:  # B: dx only (XLA drops the weight half); dy kept for W
            return state._replace(douts=[cell.dy], grad=vjp_fn(cell.dy)[1])
        if self.split:  # B: the gradients of the input and of the matmul outputs
            dx, douts = vjp_fn(cell.dy)
            return state._replace(douts=jax.tree.leaves(douts), grad=dx)
        g_w, dx = vjp_fn(cell.dy)  # BW: the gradients of the input and of the weights
        return self.accumulate(state._replace(grad=dx), cell.chunk, g_w)

    @property
    def pair(self) -> bool:
        """A (forward, backward) pair of ticks a loop step (overlapped sends)."""
        return self.prog.schedule.ticks_per_step > 1

    def put(self, state: TickState, values: list, slot) -> TickState:
        """B's douts into the slot whose residuals it read (recompute: dy into the saved
        buffer), in a conditional of its own: XLA copied the stash where one both read
        and rewrote it. With a pair of ticks a step, at the start of the next tick
        (`Carry.held`): a W in the forward tick reads what a write in the backward tick
        would overwrite, no data path orders the two, and XLA copied the whole stash
        each step; so every write of a step comes before its reads."""
        if self.recompute:
            return state._replace(saved=[state.saved[0].at[slot].set(values[0])])
        t = self.types
        return state._replace(stash=t.packing.store(state.stash, values, slot, t.douts))

    @property
    def douts_home(self) -> tuple:
        """The state's field B's douts are written into (`put`): the saved buffer
        under recompute (dy), else the stash."""
        return ("saved",) if self.recompute else ("stash",)

    def held_zeros(self) -> list:
        """Zeros like what B keeps for W (`TickState.douts`); [] without a split backward."""
        if not self.split:
            return []
        return [self.zeros(a) for a in (self.types.saved if self.recompute else self.types.douts)]

    def dispatch(self, run: Run, kind, state: TickState, cell: CellIn) -> TickState:
        """`run` on this rank. `apart`: what it keeps is stored after its conditional
        (into the spare slot where it does not run: a fresh slot of zeros), its weight
        gradients added into the accumulators (zeros where it does not run), in place."""
        if run.unconditional:  # B's douts (synchronous sends), apart
            return self.put(state, state.douts, self.slot_or_spare(run.pred(kind, cell),
                                                                    cell.slot, state))
        if "fresh" in run.writes:
            t = self.types
            zeros = {"residuals": [self.zeros(a) for a in t.residuals],
                     "kept": [self.zeros(a) for a in t.saved] if self.keeps_inputs else []}
            state = run(kind, state._replace(fresh=zeros), cell)
            slot = self.slot_or_spare(run.pred(kind, cell), cell.slot, state)
            return self.write_kept(state, slot, **state.fresh)._replace(fresh=None)
        if "g_w" not in run.writes:
            return run(kind, state, cell)
        like = jax.tree.map(lambda a: a[0, run.layers], state.grads["chunks"])
        state = run(kind, state._replace(g_w=jax.tree.map(self.zeros, like)), cell)
        grads = self.add_chunk(state.grads, cell.chunk, state.g_w, run.layers)
        return state._replace(grads=grads, g_w=None)

    def slot_or_spare(self, pred, slot, state: TickState):
        """`slot` where `pred`, else the stash's spare last slot (`apart` only)."""
        spare = next(iter(state.stash.values())).shape[0] - 1
        return jnp.where(pred, slot, spare)

    def store_douts(self, state: TickState, cell: CellIn) -> TickState:
        return self.put(state, state.douts, cell.slot)

    def embed_grad(self, state: TickState, cell: CellIn) -> TickState:
        """After the first stage's backward: the embedding's gradient from dx."""
        embed, grads = self.params["embed"], state.grads
        g_embed = jax.vjp(lambda e: self.fns.embed(e, self.inputs[cell.mb]), embed)[1](
            state.grad)[0]
        return state._replace(grads=dict(grads, embed=_add(grads["embed"], g_embed)))

    def backward_part(self, j: int):
        """The BWj cell: the fused backward of part j of the chunk's layers (bottom
        first), from that part's residuals in the stash slot; BW0 sends dx on, the
        others pass the gradient down to the part below (a message to itself)."""
        piece = self.types.pieces[j]

        def run(state: TickState, cell: CellIn) -> TickState:
            w = layer_slice(self.weights(cell.chunk), piece.lo, piece.hi)
            acts = self.types.packing.read(state.stash, cell.slot, self.types.residuals)
            vjp_fn = join_vjp(acts[piece.start:piece.start + piece.n], piece.vjp_def,
                              piece.param_slot, w)
            g_w, dx = vjp_fn(cell.dy)
            return self.accumulate(state._replace(grad=dx), cell.chunk, g_w,
                                   slice(piece.lo, piece.hi))

        return run

    def weight(self, state: TickState, cell: CellIn) -> TickState:
        t, w = self.types, self.weights(cell.chunk)
        if self.recompute:  # the full VJP again, for the weights only (dx is dropped)
            vjp_fn = join_vjp(t.packing.read(state.stash, cell.slot, t.residuals), t.vjp_def,
                              t.param_slot, w)
            g_w = vjp_fn(state.saved[0][cell.slot])[0]
        else:
            kept = jax.tree.unflatten(t.saved_def, [buf[cell.slot] for buf in state.saved])
            douts = jax.tree.unflatten(t.dout_def,
                                       t.packing.read(state.stash, cell.slot, t.douts))
            g_w = self.fns.split.weight_grads(w, kept, douts)
        return self.accumulate(state, cell.chunk, g_w)

    def runs(self) -> list[Run]:
        """In this order: each cell kind this tick runs (`self.kinds`), the head after
        F, B's stash write after B, the embedding's gradient after the backward that
        ends in dx; each with the fields of the state it writes."""
        sv, parts = ("saved",) if self.split else (), {}
        grads = "g_w" if self.apart else "grads.chunks"
        stash = ("fresh",) if self.apart else ("stash", *sv)
        if self.split:
            cells = {F: (self.forward, (*stash, "act")),
                     B: (self.backward, ("douts", "grad")),
                     W: (self.weight, (grads,))}
        else:
            cells = {F: (self.forward, (*stash, "act"))}
            bw = [(BW, self.backward)] if not self.types.pieces else [
                (kind, self.backward_part(j))
                for j, kind in enumerate(BW_PARTS[:len(self.types.pieces)])]
            parts = {kind: slice(p.lo, p.hi) for kind, p in zip(BW_PARTS, self.types.pieces)}
            cells.update({kind: (fn, (grads, "grad")) for kind, fn in bw})
        out = []
        for kind, (fn, writes) in cells.items():
            if kind in self.kinds:
                out.append(Run((KINDS[kind].scope,), kind, None, fn, writes,
                               parts.get(kind, slice(None))))
                if kind == F:
                    out.append(Run((KINDS[F].scope, ON_LAST), F, "last", self.head,
                                   ("grads.head", "grads.embed", "loss", "grad")))
                if kind == B and not self.pair:
                    out.append(Run((KINDS[B].scope,), B, None, self.store_douts,
                                   self.douts_home, unconditional=self.apart))
                if makes_dx(kind):
                    out.append(Run((KINDS[kind].scope, ON_FIRST), kind, "first",
                                   self.embed_grad, ("grads.embed",)))
        return out


def _add(tree, update):
    return jax.tree.map(jnp.add, tree, update)


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
    runs = cells.runs()
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
        douts = cells.held_zeros() if B in cells.kinds else []
        state = TickState(carry.grads, carry.loss, carry.stash, carry.saved,
                          cells.zeros(cells.types.x), cells.zeros(cells.types.x), douts)
        with jax.named_scope(CELL):
            if carry.held and phase == 0:  # the last tick's B douts (see `Cells.put`)
                values, slot, by_b = carry.held
                if cells.apart:
                    state = cells.put(state, values, cells.slot_or_spare(by_b, slot, state))
                else:
                    state = cond_fields((KINDS[B].scope,), by_b,
                                        lambda s: cells.put(s, values, slot), state,
                                        cells.douts_home)
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
