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
tick (`framework/parallel/pipeline/buffers.py`). With overlapped sends (`Schedule.overlap`)
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

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from framework.parallel.mesh import PIPE
from framework.parallel.pipeline import StageFns
from framework.parallel.pipeline.autodiff import join_vjp, split_vjp
from framework.parallel.pipeline.buffers import ACT, GRAD, Buffers, plan
from framework.parallel.pipeline.comm import (only_on, send, send_overlapped, send_weights,
                                              slots, store, zeros_typed_like)
from framework.parallel.pipeline.schedule import BW, IDLE, B, F, W, Schedule
from framework.parallel.pipeline.scopes import (CELL, CELL_SCOPES, LOOP, ON_FIRST,
                                                ON_LAST)


def scope_weights(schedule: Schedule) -> dict[str, float]:
    """Per execution of the loop body: the share of its cells on each device that run
    each branch. A kind's branch is in the dispatch of each tick of the body it may run
    in (`_kinds`). The head runs on the m F cells of the last stage, the embedding's
    gradient on the m backward cells of the first."""
    kind, m = schedule.kind, schedule.n_microbatches
    steps, p = schedule.n_ticks // schedule.ticks_per_step, schedule.n_stages
    dispatches = [_kinds(schedule, phase) for phase in range(schedule.ticks_per_step)]
    weights = {CELL_SCOPES[k]: float((kind == k).sum()) / (
        steps * p * max(1, sum(k in d for d in dispatches))) for k in CELL_SCOPES}
    weights[ON_LAST] = m / max(int((kind == F).sum()), 1)
    weights[ON_FIRST] = m / max(int(((kind == B) | (kind == BW)).sum()), 1)
    weights.update(send_weights(plan(schedule).channels, schedule.n_ticks))
    return weights


def _kinds(schedule: Schedule, phase: int) -> set:
    """The cell kinds tick `phase` of the loop's step runs somewhere in the table."""
    rows = schedule.kind[phase::schedule.ticks_per_step]
    return set(np.unique(rows).tolist()) - {IDLE}


# --- The stash: several lists of arrays in one buffer per dtype -----------------------

LANE = 128  # a stash row is [elements / LANE, LANE]: see `Packing`


def _key(a) -> str:
    """Arrays of one key share a buffer: same dtype and same varying mesh axes."""
    return f"{a.dtype}|{','.join(sorted(jax.typeof(a).manual_axis_type.varying))}"


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

    def zeros(self, n: int) -> dict:
        """{key: [n + 1, rows, LANE]}."""
        def one(key, rows):
            dtype, axes = key.split("|")
            return zeros_typed_like(jax.ShapeDtypeStruct(slots((rows, LANE), n), dtype), (),
                                    axes.split(",") if axes else ())
        return {key: one(key, rows) for key, rows in self.rows.items()}

    def store(self, stash: dict, leaves, slot, keep) -> dict:
        """Writes `leaves` into slot `slot` of the stash (the spare last slot where not
        `keep`, see `comm.store`), each at its row: no copy into one array first."""
        spare = next(iter(stash.values())).shape[0] - 1
        slot = jnp.where(keep, slot, spare)
        at = dict.fromkeys(self.rows, 0)
        stash = dict(stash)
        for a in leaves:
            key, n = _key(a), _lanes(a)
            flat = a.reshape(-1)
            if flat.size % LANE:
                flat = jnp.pad(flat, (0, n * LANE - flat.size))
            stash[key] = jax.lax.dynamic_update_slice(
                stash[key], flat.reshape(1, n, LANE), (slot, at[key], 0))
            at[key] += n
        return stash

    def read(self, stash: dict, slot, like) -> list:
        """Arrays shaped like `like`, read from slot `slot` of the stash at their rows
        (only what is asked for is copied out of the slot)."""
        at = dict.fromkeys(self.rows, 0)
        out = []
        for a in like:
            key, n = _key(a), _lanes(a)
            rows = jax.lax.dynamic_slice(stash[key], (slot, at[key], 0), (1, n, LANE))
            out.append(rows.reshape(-1)[:math.prod(a.shape)].reshape(a.shape))
            at[key] += n
        return out


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


class CellOut(NamedTuple):
    """What a cell hands to the writes and sends after the switch (zeros where unused)."""

    act: jax.Array  # [mb, seq, d] sent on the `act` channels (F's output)
    grad: jax.Array  # [mb, seq, d] sent on the `grad` channels (dL/dy or dx)
    residuals: list  # F: the VJP's residuals, for the stash slot
    douts: list  # B: the weight ops' output gradients, for the stash slot
    saved: list  # F (split backward): the weight ops' inputs; B (recompute): [dy]


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


def trace_types(fns: StageFns, params, inputs, split: bool, recompute: bool, stage) -> Types:
    """`stage`: any global stage typed like the table's (varying over `pipe`)."""
    w0 = jax.tree.map(lambda a: a[0], params["chunks"])
    x = fns.embed(params["embed"], inputs[0])
    if recompute:  # the stash as 1F1B's; `saved` holds the incoming gradient, B to W
        vjp_fn, saved, douts_tree = jax.vjp(fns.chunk(stage), w0, x)[1], [x], []
    elif split:
        _, vjp_fn, saved = fns.split_forward(stage)(w0, x)
        douts_tree = vjp_fn(x)[1]
    else:
        vjp_fn, saved, douts_tree = jax.vjp(fns.chunk(stage), w0, x)[1], [], []
    residuals, vjp_def, param_slot = split_vjp(vjp_fn, w0)
    douts = jax.tree.leaves(douts_tree)
    return Types(x, residuals, vjp_def, param_slot, jax.tree.leaves(saved),
                 jax.tree.structure(saved), douts, jax.tree.structure(douts_tree),
                 Packing.of(residuals, douts))


# --- The cells --------------------------------------------------------------------------

@dataclass(frozen=True)
class Cells:
    """The branches a rank can run in a tick, over one chunk of one microbatch. Each
    takes (grads, loss, cell: CellIn, stash, saved) and returns (grads, loss, CellOut)."""

    fns: StageFns
    params: dict  # {'embed', 'head', 'chunks' [v, Lc, ...]} of this rank
    inputs: jax.Array  # [microbatches, mb, seq] token ids
    targets: jax.Array  # [microbatches, mb, seq]
    types: Types
    manual: tuple  # mesh axes every carried value varies over
    split: bool  # the backward is split into B and W cells
    recompute: bool = False  # ... each pulling dy through the full VJP (SplitBackward)

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
        t = self.types
        nothing = lambda likes: [self.zeros(a) for a in likes]
        return CellOut(self.zeros(t.x) if act is None else act,
                       self.zeros(t.x) if grad is None else grad,
                       nothing(t.residuals) if residuals is None else residuals,
                       nothing(t.douts) if douts is None else douts,
                       nothing(t.saved) if saved is None else saved)

    def add_chunk(self, grads, chunk, update):
        v = jax.tree.leaves(grads["chunks"])[0].shape[0]
        return dict(grads, chunks=jax.tree.map(
            lambda a, u: a.at[0].add(u) if v == 1 else a.at[chunk].add(u),
            grads["chunks"], update))

    def idle(self, grads, loss, cell: CellIn, stash, saved):
        return grads, loss, self.out()

    def forward(self, grads, loss, cell: CellIn, stash, saved):
        fns, p = self.fns, self.params
        x = only_on(ON_FIRST, cell.first, lambda: fns.embed(p["embed"], self.inputs[cell.mb]),
                    lambda: cell.x)
        w = self.weights(cell.chunk)
        if self.split and not self.recompute:
            y, vjp_fn, kept = fns.split_forward(cell.stage)(w, x)
            kept = jax.tree.leaves(kept)
        else:  # (recompute: B writes the saved buffer, F leaves zeros)
            (y, vjp_fn), kept = jax.vjp(fns.chunk(cell.stage), w, x), None

        def head():  # last stage: this microbatch's loss and dL/dy for its backward
            value, (g_head, g_embed, dy) = jax.value_and_grad(
                fns.head_loss, argnums=(0, 1, 2))(p["head"], p["embed"], y,
                                                  self.targets[cell.mb])
            return (dict(grads, head=_add(grads["head"], g_head),
                         embed=_add(grads["embed"], g_embed)), loss + value, dy)

        grads, loss, dy = only_on(ON_LAST, cell.last, head,
                                  lambda: (grads, loss, self.zeros(self.types.x)))
        return grads, loss, self.out(act=y, grad=dy, residuals=split_vjp(vjp_fn, w)[0],
                                     saved=kept)

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
        embed = self.params["embed"]
        g_embed = only_on(ON_FIRST, cell.first, lambda: jax.vjp(
            lambda e: self.fns.embed(e, self.inputs[cell.mb]), embed)[1](dx)[0],
                          lambda: jax.tree.map(jnp.zeros_like, embed))
        return dict(grads, embed=_add(grads["embed"], g_embed)), loss, self.out(
            grad=dx, douts=douts, saved=kept)

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

    def branches(self, kinds: set) -> list:
        """Indexed by cell kind; the kinds not in `kinds` (this tick of the loop never
        runs them) are idle, never traced."""
        def scoped(kind, fn):
            def run(*args):
                with jax.named_scope(CELL_SCOPES[kind]):
                    return fn(*args)
            return run if kind in kinds else self.idle

        if self.split:
            return [self.idle, scoped(F, self.forward), scoped(B, self.backward),
                    scoped(W, self.weight), self.idle]
        return [self.idle, scoped(F, self.forward), self.idle, self.idle,
                scoped(BW, self.backward)]


def _add(tree, update):
    return jax.tree.map(jnp.add, tree, update)


# --- The tick loop ----------------------------------------------------------------------

def _table(schedule: Schedule, buffers: Buffers) -> dict:
    """The table and its buffer plan as the scan's per-step inputs: [steps, ticks per
    step, ranks] arrays (the sends: [steps, ticks per step] pattern per channel)."""
    stage, k = schedule.global_stage, schedule.ticks_per_step
    table = {
        "kind": schedule.kind, "mb": schedule.microbatch, "chunk": schedule.chunk,
        "stage": stage, "stash": buffers.stash, "read": buffers.read,
        "first": stage == 0, "last": stage == schedule.n_global_stages - 1,
        "arrive": [ch.arrive for ch in buffers.channels],
        "pattern": [ch.pattern for ch in buffers.channels]}
    return jax.tree.map(lambda a: jnp.asarray(a).reshape(-1, k, *a.shape[1:]), table)


def _tick(cells: Cells, buffers: Buffers, rank, phase: int, kinds: set):
    """Tick `phase` of a loop step on this rank: start sending the last tick's messages
    (overlapped), read the cell's inputs, run its branch, write the stash, send or
    receive and store the messages."""
    branches, packing = cells.branches(kinds), cells.types.packing
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
        stash = packing.store(carry.stash, out.residuals, k_stash, kind == F)
        if cells.split and not cells.recompute:
            stash = packing.store(stash, out.douts, k_stash, kind == B)
        written = kind == (B if cells.recompute else F)  # the saved buffers' writer
        saved = [store(buf, e, k_stash, written) for buf, e in zip(carry.saved, out.saved)]
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


def _step(cells: Cells, schedule: Schedule, buffers: Buffers, rank):
    """The loop's body: one tick, or a (forward, backward) pair when sends overlap."""
    ticks = [_tick(cells, buffers, rank, phase, _kinds(schedule, phase))
             for phase in range(schedule.ticks_per_step)]

    def step(carry: Carry, rows: dict):
        for phase, tick in enumerate(ticks):
            carry = tick(carry, jax.tree.map(lambda a: a[phase], rows))
        return carry, None

    return step


def loss_and_grads(schedule: Schedule, fns: StageFns, params, inputs, targets):
    """params: {'embed', 'head', 'chunks' [v, Lc, ...] of this rank}, varying over the
    manual axes. inputs, targets: [microbatches, mb, seq]. Returns (this rank's loss
    share, gradients like params)."""
    split = schedule.split_backward
    if split and fns.split is None:
        raise ValueError(f"schedule {schedule.name} splits the backward: StageFns.split is needed")
    buffers = plan(schedule)
    manual = tuple(sorted(jax.typeof(inputs).manual_axis_type.varying | {PIPE}))
    recompute = split and fns.split.recompute
    rank = jax.lax.axis_index(PIPE)
    cells = Cells(fns, params, inputs, targets,
                  trace_types(fns, params, inputs, split, recompute, rank), manual, split,
                  recompute)
    n, t = buffers.n_slots, cells.types
    init = Carry(recv={b: cells.zeros(t.x, n[b]) for b in (ACT, GRAD) if n[b]},
                 stash=t.packing.zeros(n["stash"]),
                 saved=[cells.zeros(a, n["stash"]) for a in t.saved],
                 grads=jax.tree.map(cells.zeros, params),
                 loss=cells.zeros(jnp.zeros((), jnp.float32)),
                 pending={ch.buffer: cells.zeros(t.x) for ch in buffers.channels if ch.overlap})
    with jax.named_scope(LOOP):
        final, _ = jax.lax.scan(_step(cells, schedule, buffers, rank), init,
                                _table(schedule, buffers))
    return final.loss, final.grads
