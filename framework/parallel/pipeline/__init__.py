"""Pipeline parallelism.

  schedule.py   schedules as (tick, rank) tables of F / B / W / BW cells; a registry of
                table generators (a new schedule is one generator)
  buffers.py    the stash and receive slots and the point-to-point sends every table
                implies, and the check that no slot is overwritten while live
  comm.py       sends and per-rank control flow
  scopes.py     the named scopes the audit and the profiler read
  autodiff.py   executor: runs a table's forward rows, JAX autodiff the backward
                (GPipe, circular)
  ticks.py      executor: runs every cell of any table itself (1F1B, interleaved 1F1B,
                zero-bubble), backward included
  layout.py     which layers live on which rank and chunk

Both executors have one interface, `loss_and_grads(schedule, fns, params, inputs,
targets) -> (loss, grads)` and `scope_weights(schedule) -> {scope: share}` (for the
communication audit), and get the model as `StageFns`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import jax.numpy as jnp


@dataclass(frozen=True)
class SplitBackward:
    """The backward of a layer chunk in two halves (zero-bubble schedules, Qi et al. 2024):
    `forward(w, x) -> (y, vjp, saved)`, where `vjp(dy) -> (dx, dout)` is the B half
    (a `jax.vjp` function of the input and of the weight matmuls' outputs) and `saved`
    the matmul inputs; `weight_grads(w, saved, dout) -> dw` is the W half.

    recompute (under rematerialisation): B and W each pull the incoming gradient through
    the chunk's full VJP, rebuilt from the residuals F stashed (the layer inputs), B
    keeping dx and W the weight gradients; between them only that incoming gradient is
    kept. The matmul inputs and output gradients per layer that the halves above hold
    would be several times the rematerialised stash (`forward` and `weight_grads` are
    then unused)."""

    forward: Callable
    weight_grads: Callable
    recompute: bool = False


@dataclass(frozen=True)
class StageFns:
    """What an executor needs from the model, on one device (tensor-parallel inside)."""

    embed: Callable  # (embed params, ids [mb, seq]) -> x [mb, seq (/tensor with SP), d]
    layers: Callable  # (chunk params [Lc, ...], x, n_real=None) -> y, like x
    head_loss: Callable  # (head params, embed params, y, targets [mb, seq]) -> loss share
    split: Optional[SplitBackward] = None  # needed by tables with B and W cells
    # Uneven stages (`parallel.stage_layers`): real layers per global stage; each chunk
    # holds max(stage_layers), the rest padding (`layout.py`). None: all chunks full.
    stage_layers: Optional[tuple] = None

    def real(self, stage):
        """The real layers of global stage `stage`'s chunk (traced), None when even."""
        return None if self.stage_layers is None else jnp.asarray(
            self.stage_layers, jnp.int32)[stage]

    def chunk(self, stage) -> Callable:
        """(chunk params, x) -> y of the chunk of global stage `stage` (traced int)."""
        return partial(self.layers, n_real=self.real(stage))

    def split_forward(self, stage) -> Callable:
        """`split.forward` of the chunk of global stage `stage`."""
        return partial(self.split.forward, n_real=self.real(stage))


def executor(schedule):
    """The executor module that runs `schedule`."""
    from framework.parallel.pipeline import autodiff, ticks
    from framework.parallel.pipeline.schedule import AUTODIFF

    return autodiff if schedule.executor == AUTODIFF else ticks
