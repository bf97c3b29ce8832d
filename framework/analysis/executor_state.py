"""The tick executor's own state, measured: what `framework/analysis/memory_model.py`
counts for the 1F1B family's receive slots, stash, saved buffers, gradient
accumulators and pending sends. Not recounted from the buffer plan: traced, with
`jax.eval_shape`, through the executor's own `initial_carry` inside the step's own
per-device setup, on an abstract mesh (no devices, nothing compiled)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, PartitionSpec as P

from framework.config import ModelConfig, ParallelConfig
from framework.engine.state import abstract_train_params, param_specs
from framework.engine.step import device_fn, passes_through
from framework.parallel.data import gathers_per_use
from framework.parallel.mesh import AXES, DATA, PIPE
from framework.parallel.pipeline import ticks
from framework.parallel.pipeline.program import program_of



def nbytes(tree) -> int:
    """Bytes of the arrays (or shapes) of a pytree."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


_STATES: dict = {}


def executor_state(model: ModelConfig, parallel: ParallelConfig, batch: int, seq: int,
                   platform: str | None = None) -> dict:
    """`measure_executor_state`, once per distinct shape of the state (`state_key`): the
    planner asks for hundreds of layouts that share far fewer (one trace takes a third
    of a second here)."""
    through = passes_through(platform or jax.default_backend())
    key = state_key(model, parallel, batch, seq) + (through,)
    if key not in _STATES:
        _STATES[key] = measure_executor_state(model, parallel, batch, seq, through)
    return _STATES[key]


def state_key(model: ModelConfig, parallel: ParallelConfig, batch: int, seq: int) -> tuple:
    """Everything the shapes of the tick executor's state depend on: the model and the
    tensor-parallel plan (their per-device weights and activations), the chunks a rank
    holds and their layers (padded or not), a microbatch's rows and tokens, the buffer
    plan's slot counts, which buffers send overlapped, the backward's cells, and FSDP's
    sharding of the gradient accumulators."""
    prog = program_of(parallel, model.n_layers)
    s, layers = prog.schedule, prog.stage_layers
    chunk = max(layers) if layers else model.n_layers // s.n_global_stages
    pending = tuple(sorted({ch.buffer for ch in prog.buffers.channels if ch.overlap}))
    return (model, parallel.tensor, parallel.context, parallel.sequence_parallel, parallel.remat,
            tuple(parallel.tensor_split), s.n_chunks, chunk, layers is not None,
            batch // parallel.data // parallel.microbatches, seq,
            tuple(sorted(prog.buffers.n_slots.items())), pending, s.split_backward, s.parts,
            parallel.data if gathers_per_use(parallel) else None)  # FSDP: sharded grads


def measure_executor_state(model: ModelConfig, parallel: ParallelConfig, batch: int,
                           seq: int, pass_through: bool = True) -> dict:
    """Bytes per device of the tick executor's own state before its first tick (its
    `Carry`: receive slots, stash, saved, gradient accumulators, pending sends), by
    field, and of one stash slot's entry (`slot`). Measured, not recounted:
    `jax.eval_shape` of the executor's `initial_carry`, inside the step's own
    per-device setup (`engine.step.device_fn`) in a `shard_map` over an abstract mesh of
    the layout's degrees (no devices), for a global batch of `batch` rows of `seq`
    tokens. `pass_through`: as the target's compiler (`engine.step.passes_through`:
    on GPUs the stash has a spare slot)."""
    prog = program_of(parallel, model.n_layers)
    specs, zero1_dims = param_specs(model, parallel, prog.schedule.n_chunks)
    shapes = abstract_train_params(model, parallel.pipeline, prog.schedule.n_chunks,
                                   parallel.stage_layers)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    found = {}

    def measure(fns, params, inputs, targets, docs):  # per device, at trace time only
        cells = ticks.make_cells(prog, fns, params, inputs, targets,
                                 jax.lax.axis_index(PIPE))
        found.update({k: nbytes(v) for k, v in ticks.initial_carry(cells)._asdict().items()})
        slot = nbytes(cells.types.packing.zeros(1))
        saved = nbytes([cells.zeros(a, 0) for a in cells.types.saved])
        found["slot"] = slot + saved
        return jnp.zeros(())

    body = device_fn(model, parallel, prog, zero1_dims, measure, prog.schedule.split_backward,
                     pass_through=pass_through)
    mesh = AbstractMesh((parallel.pipeline, parallel.data, parallel.context, parallel.tensor),
                        AXES)
    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DATA)), out_specs=P()),
                   shapes, tokens)
    return found
