"""What each kind of cell does to the tick state: the tick executor's work, one method
per kind (`Cells.work`), on one chunk of one microbatch (framework/parallel/pipeline/
ticks.py runs them; how they are lowered for each compiler is lowering.py's).

  F(i, c)   x = the embedded microbatch (first stage) or its receive slot; chunk c's
            layers, each under its own jax.vjp, whose residuals (the activations the
            backward needs; parameters are recognised by identity and never copied)
            go straight into that layer's rows of the microbatch's stash slot
            (`stash.scan_into`; a split backward keeping the weight ops' inputs: the
            VJP of the input and the weight ops' outputs, and those inputs into the
            layer's row of the saved buffers). The last stage then runs head + loss and
            keeps dL/dy for its own backward.
  BW(i, c)  the layers in reverse, each layer's VJP rebuilt from its rows of the slot
            (`stash.scan_from`): the weight gradients (`g_w`, to add) and dx to send on.
  B(i, c)   (split backward) the same reverse loop, each layer's VJP w.r.t. its input
            and its weight matmuls' outputs only: dx is sent on, the matmul output
            gradients (`douts`) overwrite the (now dead) residuals in the stash slot,
            next to the matmul inputs F saved.
  W(i, c)   the weight gradients from that slot: one matmul per weight.
  BWj(i, c) BW over part j of the chunk's layers, from that part's residuals; BW0 sends
            dx on, the others pass the gradient down to the part below.
  F+BW      (`parallel.combined_1f1b`) F(i, c) and BW(j, c') as one cell: one loop over
            the layers, F's layer n-1-l beside BW's layer l (`stash.scan_fused`).

Under rematerialisation (`SplitBackward.recompute`) the stash is 1F1B's (the layer
inputs): B pulls dy through the chunk's full VJP for dx, keeps dy (one message's size),
and W pulls it through again for the weight gradients. Memory: 1F1B's plus one message
per microbatch in flight; compute: the chunk's recomputed forward and input gradient
run twice (B and W) instead of once.

A cell's work makes what its kind's row says (`kinds.CellKind.writes`); what it keeps
and its weight gradients it hands on (`fresh`, `g_w`), and `write_kept` and `accumulate`
put them in place (inside the cell's conditional, or after it: `lowering.py`).

Shapes: mb = rows of a microbatch, seq = its tokens (/tensor with sequence
parallelism), d = d_model; n = slots of a buffer (+1: the spare row, `comm.slots`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from framework.parallel.pipeline.comm import only_on, slots, write_slot, zeros_typed_like
from framework.parallel.pipeline.kinds import BW, B, CellKind, F, W
from framework.parallel.pipeline.program import Program
from framework.parallel.pipeline.scopes import ACCUMULATE, ON_FIRST
from framework.parallel.pipeline.stage import StageFns, no_float0, of_microbatch
from framework.parallel.pipeline.stash import scan_from, scan_fused, scan_into
from framework.parallel.pipeline.tick_types import (CellIn, TickState, Types, layer_slice,
                                                    layers_of)


@dataclass(frozen=True)
class Cells:
    """The cells a rank can run in a tick. Each kind's work takes (state: TickState,
    cell: CellIn) and returns the state it updates (`work`)."""

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

    def work(self, kind: CellKind):
        """The function that does a cell of `kind`: (state, cell) -> state."""
        if kind.part is not None:
            return self.backward_part(kind.part)
        return {F: self.forward, B: self.backward, W: self.weight, BW: self.backward}[kind.code]

    # --- Helpers ------------------------------------------------------------------------

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
        """grads of chunk `chunk` (its `layers`, a static slice) += update (in the
        accumulators' dtype: the stored one, `StageFns.weights`). An integer leaf has
        no gradient and no accumulator (None in both: `stage.no_float0`)."""
        v = jax.tree.leaves(grads["chunks"])[0].shape[0]
        with jax.named_scope(ACCUMULATE):
            return dict(grads, chunks=jax.tree.map(
                lambda a, u: a.at[0 if v == 1 else chunk, layers].add(u.astype(a.dtype)),
                grads["chunks"], update))

    @property
    def keeps_inputs(self) -> bool:
        """F keeps the weight ops' inputs for W (a split backward without remat)."""
        return self.split and not self.recompute

    @property
    def pair(self) -> bool:
        """A (forward, backward) pair of ticks a loop step (overlapped sends)."""
        return self.prog.schedule.ticks_per_step > 1

    def held_zeros(self) -> list:
        """Zeros like what B keeps for W (`TickState.douts`); [] without a split backward."""
        if not self.split:
            return []
        return [self.zeros(a) for a in (self.types.saved if self.recompute else self.types.douts)]

    # --- Where what a cell makes goes ---------------------------------------------------

    def fresh_zeros(self) -> dict:
        """What F hands on (`fresh`, where the compiler copies what a conditional passes
        through) where it does not run: one stash slot {key: [1, rows, LANE]} and,
        keeping the weight ops' inputs, one slot of the saved buffers [1, Lc, ...]."""
        return {"slot": self.types.packing.zeros(1, self.manual), "saved": self.saved_slot()}

    def saved_slot(self) -> list:
        """One slot of the saved buffers, [1, Lc, ...] each ([] unless F keeps them)."""
        return [self.zeros(a, 0) for a in self.types.saved] if self.keeps_inputs else []

    def write_kept(self, state: TickState, cell: CellIn) -> TickState:
        """F's slot (`fresh`: its layers' residuals, [1, rows, LANE], and the weight
        ops' inputs it keeps, [1, Lc, ...]) into slot `cell.slot` of the stash and
        of the saved buffers."""
        fresh = state.fresh
        at = lambda a: (cell.slot,) + (0,) * (a.ndim - 1)
        saved = [jax.lax.dynamic_update_slice(buf, e, at(buf))
                 for buf, e in zip(state.saved, fresh["saved"])]
        return state._replace(fresh=None, saved=saved or state.saved, stash={
            k: jax.lax.dynamic_update_slice(buf, fresh["slot"][k], at(buf))
            for k, buf in state.stash.items()})

    def accumulate(self, state: TickState, cell: CellIn, layers=slice(None)) -> TickState:
        """The gradients of chunk `cell.chunk` (its `layers`) += the cell's `g_w`."""
        grads = self.add_chunk(state.grads, cell.chunk, state.g_w, layers)
        return state._replace(grads=grads, g_w=None)

    def put(self, state: TickState, values: list, slot) -> TickState:
        """B's douts into the slot whose residuals it read (recompute: dy into the saved
        buffer), in a conditional of its own: XLA copied the stash where one both read
        and rewrote it. With a pair of ticks a step, at the start of the next tick
        (`Carry.held`): a W in the forward tick reads what a write in the backward tick
        would overwrite, no data path orders the two, and XLA copied the whole stash
        each step; so every write of a step comes before its reads."""
        if self.recompute:
            return state._replace(saved=[write_slot(state.saved[0], values[0], slot)])
        t = self.types
        return state._replace(stash=t.packing.store(state.stash, values, slot, t.douts))

    def store_douts(self, state: TickState, cell: CellIn) -> TickState:
        return self.put(state, state.douts, cell.slot)

    # --- The work of each kind ----------------------------------------------------------

    def forward(self, state: TickState, cell: CellIn) -> TickState:
        """F: the chunk's forward, its output to `act`; its VJP's residuals go into the
        microbatch's stash slot layer by layer as the layers run (`stash.scan_into`),
        or (a split backward that keeps the weight ops' inputs) are handed on whole
        with those inputs (`fresh`)."""
        fns, p = self.fns, self.params
        w, docs = self.weights(cell.chunk), of_microbatch(self.docs, cell.mb)
        x = only_on(ON_FIRST, cell.first,
                    lambda: fns.embed(p["embed"], self.inputs[cell.mb], docs), lambda: cell.x)
        first = self.prog.first(cell.stage, jax.tree.leaves(w)[0].shape[0])
        x, stash, saved = self.forward_in_place(state, cell, w, x, docs, first)
        if self.fns.pass_through:  # (recompute: B writes the saved buffer)
            return state._replace(stash=stash, saved=saved or state.saved, act=x)
        return state._replace(fresh={"slot": stash, "saved": saved}, act=x)  # (`apart`)

    def forward_in_place(self, state: TickState, cell: CellIn, w, x, docs, first):
        """The chunk's layers on x [mb, seq, d], each layer's residuals written into its
        rows of the microbatch's stash slot as it runs (`stash.scan_into`), and the
        weight ops' inputs, if kept, into its row of the saved buffers: (y, the stash,
        the saved buffers ([] if not kept)). Where the compiler copies what a
        conditional passes through (`StageFns.pass_through`), into a fresh slot of each
        instead, which `write_kept` puts in place after the conditional."""
        t, n_real, split = self.types, self.prog.real(cell.stage), self.keeps_inputs
        stash, saved, slot = ((state.stash, state.saved if split else [], cell.slot)
                              if self.fns.pass_through else
                              (t.packing.zeros(1, self.manual), self.saved_slot(), 0))
        for piece in t.pieces:
            scan, out = scan_into(t.packing, stash, slot, piece, saved if split else None)
            run = layers_of(self.fns, n_real, len(t.pieces), docs, first, piece.lo, piece.hi,
                            split)
            x = run(layer_slice(w, piece.lo, piece.hi), x, scan=scan)
            stash, saved = out["carry"] if split else (out["carry"], saved)
        return x, stash, saved

    def combined(self, state: TickState, f: CellIn, b: CellIn) -> TickState:
        """F+BW: F of cell `f` and BW of cell `b` (another microbatch, maybe another
        chunk) in one loop over the layers (`stash.scan_fused`): F's output to `act`, its
        residuals into its slot (in place, or a fresh slot where the compiler copies what
        a conditional passes through), BW's weight gradients to `g_w` and dx to `grad`."""
        fns, p, t = self.fns, self.params, self.types
        x = only_on(ON_FIRST, f.first, lambda: fns.embed(
            p["embed"], self.inputs[f.mb], of_microbatch(self.docs, f.mb)), lambda: f.x)
        w = self.weights(f.chunk)
        first = self.prog.first(f.stage, jax.tree.leaves(w)[0].shape[0])
        stash, slot = ((state.stash, f.slot) if self.fns.pass_through
                       else (t.packing.zeros(1, self.manual), 0))
        piece = t.pieces[0]  # (a whole BW: one piece)
        scan, out = scan_fused(t.packing, stash, slot, piece,
                               (self.weights(b.chunk), b.dy, b.slot),
                               None if self.fns.pass_through else state.stash)
        run = layers_of(fns, self.prog.real(f.stage), 1, of_microbatch(self.docs, f.mb),
                        first, piece.lo, piece.hi)
        y = run(w, x, scan=scan)
        kept = {"stash": out["carry"]} if self.fns.pass_through else {
            "fresh": {"slot": out["carry"], "saved": []}}
        return state._replace(act=y, grad=out["dx"], g_w=no_float0(out["g_w"]), **kept)

    def head(self, state: TickState, cell: CellIn) -> TickState:
        """After F on the last stage: the microbatch's loss, and dL/dy for its backward."""
        fns, p, grads = self.fns, self.params, state.grads
        value, (g_head, g_embed, dy) = jax.value_and_grad(fns.head_loss, argnums=(0, 1, 2))(
            p["head"], p["embed"], state.act, self.targets[cell.mb])
        grads = dict(grads, head=add(grads["head"], g_head), embed=add(grads["embed"], g_embed))
        return state._replace(grads=grads, loss=state.loss + value, grad=dy)

    def in_place(self, state: TickState, cell: CellIn, j: int, dy):
        """The backward of piece j of the chunk's layers from its rows of the stash slot
        (`stash.scan_from`): (weight gradients [its layers, ...], dx)."""
        piece, w = self.types.pieces[j], self.weights(cell.chunk)
        g_w, dx = scan_from(self.types.packing, state.stash, cell.slot, piece,
                            layer_slice(w, piece.lo, piece.hi), dy)
        return no_float0(g_w), dx

    def backward(self, state: TickState, cell: CellIn) -> TickState:
        """BW, or B when the backward is split (its weight half comes later, in W)."""
        if self.recompute:  # B: dx only (XLA drops the weight half); dy kept for W
            return state._replace(douts=[cell.dy], grad=self.in_place(state, cell, 0, cell.dy)[1])
        if not self.split:  # BW: the gradients of the input and of the weights
            g_w, dx = self.in_place(state, cell, 0, cell.dy)
            return state._replace(grad=dx, g_w=g_w)
        # B: the gradients of the input and of the weight ops' outputs, layer by layer
        douts, dx = scan_from(self.types.packing, state.stash, cell.slot, self.types.pieces[0],
                              self.weights(cell.chunk), cell.dy, split=True)
        return state._replace(douts=jax.tree.leaves(douts), grad=dx)

    def backward_part(self, j: int):
        """The BWj cell: the fused backward of part j of the chunk's layers (bottom
        first), from that part's rows of the stash slot; BW0 sends dx on, the others
        pass the gradient down to the part below (a message to itself)."""
        def run(state: TickState, cell: CellIn) -> TickState:
            g_w, dx = self.in_place(state, cell, j, cell.dy)
            return state._replace(grad=dx, g_w=g_w)

        return run

    def weight(self, state: TickState, cell: CellIn) -> TickState:
        """W: the weight gradients, from the microbatch's stash slot and saved buffers."""
        t, w = self.types, self.weights(cell.chunk)
        if self.recompute:  # the full backward again, for the weights only (dx is dropped)
            g_w = self.in_place(state, cell, 0, state.saved[0][cell.slot])[0]
        else:
            kept = jax.tree.unflatten(t.saved_def, [buf[cell.slot] for buf in state.saved])
            douts = jax.tree.unflatten(t.dout_def,
                                       t.packing.read(state.stash, cell.slot, t.douts))
            g_w = no_float0(self.fns.split.weight_grads(w, kept, douts))
        return state._replace(g_w=g_w)

    def embed_grad(self, state: TickState, cell: CellIn) -> TickState:
        """After the first stage's backward: the embedding's gradient from dx (and a dense
        prefix's, recomputed from the ids: framework/model/prefix.py)."""
        embed, grads = self.params["embed"], state.grads
        docs = of_microbatch(self.docs, cell.mb)
        g_embed = jax.vjp(lambda e: self.fns.embed(e, self.inputs[cell.mb], docs), embed)[1](
            state.grad)[0]
        return state._replace(grads=dict(grads, embed=add(grads["embed"], g_embed)))


def add(tree, update):
    """tree + update, leaf by leaf, in the tree's dtypes (a gradient into its accumulator)."""
    with jax.named_scope(ACCUMULATE):
        return jax.tree.map(lambda a, u: a + u.astype(a.dtype), tree, update)
