"""How the cells are lowered for a compiler: each branch a tick's dispatch opens
(`Program.branches`) becomes a `Run`, its own two-way `lax.cond` on "this rank's cell is
of that kind" (and, for the head and the embedding's gradient, on the stage), run in
order. A conditional returns only the fields of the tick's state its branch writes
(typed, `tick_types.Field`); what it reads is an operand, not an output (XLA copied a
stash that one conditional both read and returned). A single `lax.switch` over the
kinds, as before, copied the gradient accumulators in every branch that left them alone
and again after it, and built a slot of zeros for the stash write of every cell but F:
1F1B with synchronous sends took 1.31x GPipe's step here, 0.93x now.

Two lowerings of what a cell keeps (F's residuals, `fresh`) and its weight gradients
(`g_w`), chosen by the compiler (`StageFns.pass_through`, `engine.step.passes_through`):

  pass-through  (XLA's CPU and TPU compilers, its GPU compiler from jaxlib 0.11.2) they
                are written in place inside the branch (F's layer by layer,
                `Cells.forward_in_place`; `Cells.accumulate`); the other ranks pass
                the state through, and the compiler keeps a value passed through a
                two-way conditional in its buffer.
  apart         (the GPU compiler before jaxlib 0.11.2 copies what a conditional passes
                through) they leave the branch as fresh values and are written in place
                after it: zeros where the cell does not run, written to a spare stash
                slot / added to the gradients. B's douts are then written on every rank
                (into the spare slot where B does not run), with no conditional; the
                embedding's conditional returns the looked-up rows' gradient, which is
                scatter-added into the table's after it (`embed_grad_apart`).

The named scopes the branches open are the Program's (`Branch.scopes`), so the audit's
weights (`Program.scope_weights`) are computed from the same branches this lowers.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from framework.parallel.pipeline import cells
from framework.parallel.pipeline.comm import varying, zeros_typed_like
from framework.parallel.pipeline.kinds import Out
from framework.parallel.pipeline.program import Branch, Role
from framework.parallel.pipeline.stage import differentiable
from framework.parallel.pipeline.tick_types import (CellIn, Field, TickState, fields_of,
                                                    with_fields)


class Run(NamedTuple):
    """`fn(state, cell)` (then, in the branch, `then(state, cell)`) on the ranks whose cell
    is of `kind` (and, `on` "first" / "last", whose stage is the first / last), as its own
    two-way conditional that returns only the fields of the state in `writes`."""

    scopes: tuple  # named scopes, outermost first
    kind: int
    on: Optional[str]
    fn: Callable
    writes: tuple  # Field, ...
    role: Role
    layers: slice = slice(None)  # the chunk's layers whose gradients it makes (BWj)
    then: Optional[Callable] = None  # pass-through: what the work hands on, in place

    def pred(self, kind, cell: CellIn):
        """Whether it runs on this rank this tick."""
        pred = kind == self.kind
        if self.on is not None:
            pred = pred & (cell.first if self.on == "first" else cell.last)
        return pred

    def __call__(self, kind, state: TickState, cell: CellIn) -> TickState:
        pred = self.pred(kind, cell)
        return cond_fields(self.scopes, pred, lambda s: self.fn(s, cell) if self.then is None
                           else self.then(self.fn(s, cell), cell), state, self.writes)


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

    with in_scopes(scopes):
        out = jax.lax.cond(pred, run, lambda s: fields_of(s, writes), state)
    return with_fields(state, writes, out)


@contextmanager
def in_scopes(scopes: tuple):
    """JAX's named scopes `scopes`, nested, outermost first."""
    with ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(jax.named_scope(scope))
        yield


_HEAD = (Field.GRADS_HEAD, Field.GRADS_EMBED, Field.LOSS, Field.GRAD)  # head + loss


class Cells(cells.Cells):
    """The cells of `cells.py`, lowered: `lower` makes a tick's branch a conditional and
    `dispatch` runs it, as this compiler needs (`apart`). (Named as its base: the
    compiled program's locations name the frames that trace it, `Cells.dispatch`.)"""

    @property
    def apart(self) -> bool:
        """A cell's weight gradients and what it keeps leave its conditional as fresh
        values, added / written in place after it (zeros, the spare stash slot, where
        it does not run: `dispatch`), for a compiler that would copy what a conditional
        passes through (`StageFns.pass_through`: the GPU's before jaxlib 0.11.2)."""
        return not self.fns.pass_through

    def fields(self, out: Out) -> tuple:
        """The fields of the tick state a branch that makes `out` writes."""
        if out is Out.KEPT:  # in place, or a fresh slot put in place after the branch
            return (Field.FRESH,) if self.apart else (
                (Field.STASH, Field.SAVED) if self.keeps_inputs else (Field.STASH,))
        if out is Out.WEIGHT_GRADS:
            return (Field.G_W,) if self.apart else (Field.GRADS_CHUNKS,)
        return (Field[out.name],)

    def lower(self, branch: Branch) -> Run:
        """The conditional of one branch of a tick's dispatch: a kind's work writes the
        fields of what its row says it makes (`CellKind.writes`), and, passing through,
        puts what it keeps and its weight gradients in place in the branch."""
        kind, role = branch.kind, branch.role
        if role is Role.WORK:
            layers, then = slice(None), None
            if kind.part is not None:
                piece = self.types.pieces[kind.part]
                layers = slice(piece.lo, piece.hi)
            if not self.apart and Out.WEIGHT_GRADS in kind.writes:
                then = partial(self.accumulate, layers=layers)
            writes = tuple(f for out in kind.writes for f in self.fields(out))
            return Run(branch.scopes, kind.code, branch.on, self.work(kind), writes, role,
                       layers, then)
        if role is Role.HEAD:
            return Run(branch.scopes, kind.code, branch.on, self.head, _HEAD, role)
        if role is Role.EMBED_GRAD:
            return Run(branch.scopes, kind.code, branch.on, self.embed_grad,
                       (Field.GRADS_EMBED,), role)
        douts = (Field.SAVED,) if self.recompute else (Field.STASH,)  # (recompute: dy)
        return Run(branch.scopes, kind.code, branch.on, self.store_douts, douts, role)

    def dispatch(self, run: Run, kind, state: TickState, cell: CellIn) -> TickState:
        """`run` on this rank. `apart`: what it keeps is stored after its conditional
        (into the spare slot where it does not run: a fresh slot of zeros), its weight
        gradients added into the accumulators (zeros where it does not run), in place;
        B's douts are written on every rank. The last tick's B douts come from `cell.held`
        (values, slot, whether B ran)."""
        if run.role is Role.HELD_DOUTS:
            values, slot, by_b = cell.held
            if self.apart:
                return self.put(state, values, self.slot_or_spare(by_b, slot, state))
            return cond_fields(run.scopes, by_b, partial(self.put, values=values, slot=slot),
                               state, run.writes)
        if run.role is Role.STORE_DOUTS and self.apart:
            return self.put(state, state.douts, self.slot_or_spare(run.pred(kind, cell),
                                                                    cell.slot, state))
        if run.role is Role.EMBED_GRAD and self.apart and self.fns.embed_rows:
            return self.embed_grad_apart(run.scopes, run.pred(kind, cell), state, cell)
        if Field.FRESH in run.writes:
            state = run(kind, state._replace(fresh=self.fresh_zeros()), cell)
            slot = self.slot_or_spare(run.pred(kind, cell), cell.slot, state)
            return self.write_kept(state, cell._replace(slot=slot))
        if Field.G_W not in run.writes:
            return run(kind, state, cell)
        like = jax.tree.map(lambda a: a[0, run.layers], differentiable(self.params["chunks"]))
        state = run(kind, state._replace(g_w=jax.tree.map(self.zeros, like)), cell)
        grads = self.add_chunk(state.grads, cell.chunk, state.g_w, run.layers)
        return state._replace(grads=grads, g_w=None)

    def embed_grad_apart(self, scopes: tuple, pred, state: TickState, cell: CellIn):
        """`embed_grad` for `apart`: its conditional returns the looked-up rows' gradient
        (zeros where it does not run), which a scatter-add after it puts into the
        table's gradient in place on every rank (`StageFns.embed_rows`): the accumulator
        (float32 [vocab/tensor, d], 1 GiB for Llama-3-70B at tensor 4) passes through no
        conditional, which this compiler copied three times a tick."""
        rows, table = self.fns.embed_rows
        embed, ids = self.params["embed"], self.inputs[cell.mb]
        made = lambda: rows(embed, ids, state.grad)
        like = jax.eval_shape(made)
        none = lambda: zeros_typed_like(like, also=like.manual_axis_type.varying)
        with in_scopes(scopes):
            got = jax.lax.cond(pred, made, none)
        grads = state.grads
        return state._replace(grads=dict(grads, embed=cells.add(grads["embed"],
                                                               table(embed, ids, got))))

    def slot_or_spare(self, pred, slot, state: TickState):
        """`slot` where `pred`, else the stash's spare last slot (`apart` only)."""
        spare = next(iter(state.stash.values())).shape[0] - 1
        return jnp.where(pred, slot, spare)


def run_combined(cells: Cells, fused, state: TickState, f: CellIn, b: CellIn) -> TickState:
    """The combined cell (F of `f`, BW of `b`) where `fused`, as the conditionals of
    `Program.combined_branches` but the head's (`head_combined`), lowered as `Cells.lower`
    lowers F's and BW's: what F keeps and BW's weight gradients in place in the branch
    (pass-through), or after it (`apart`: the spare slot, zeros where it did not run)."""
    work, embed, _ = cells.prog.combined_branches()
    fn = lambda s: cells.combined(s, f, b)
    if cells.apart:
        like = jax.tree.map(lambda a: a[0], differentiable(cells.params["chunks"]))
        state = state._replace(fresh=cells.fresh_zeros(), g_w=jax.tree.map(cells.zeros, like))
        state = cond_fields(work.scopes, fused, fn, state,
                            (Field.FRESH, Field.ACT, Field.G_W, Field.GRAD))
        state = cells.write_kept(state, f._replace(slot=cells.slot_or_spare(fused, f.slot, state)))
        state = state._replace(grads=cells.add_chunk(state.grads, b.chunk, state.g_w), g_w=None)
    else:
        state = cond_fields(work.scopes, fused, lambda s: cells.accumulate(fn(s), b), state,
                            (Field.STASH, Field.ACT, Field.GRADS_CHUNKS, Field.GRAD))
    if cells.apart and cells.fns.embed_rows:
        return cells.embed_grad_apart(embed.scopes, fused & b.first, state, b)
    return cond_fields(embed.scopes, fused & b.first, lambda s: cells.embed_grad(s, b), state,
                       (Field.GRADS_EMBED,))


def head_combined(cells: Cells, fused, state: TickState, f: CellIn) -> TickState:
    """After a combined cell on the last stage: the head and loss of its F."""
    head = cells.prog.combined_branches()[2]
    return cond_fields(head.scopes, fused & f.last, lambda s: cells.head(s, f), state, _HEAD)
