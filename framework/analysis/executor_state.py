"""The tick executor's own state, measured: what `framework/analysis/memory_model.py`
counts for the 1F1B family's receive slots, stash, saved buffers, gradient
accumulators and pending sends. Not recounted from the buffer plan: traced, with
`jax.eval_shape`, through the executor's own `initial_carry` inside the step's own
per-device setup, on an abstract mesh (no devices, nothing compiled)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from framework.config import ModelConfig, ParallelConfig
from framework.engine.resolved import Layout, resolved, with_exchange
from framework.engine import step_weights
from framework.engine.state import abstract_train_params, param_specs
from framework.engine.step import StepOptions, device_fn, passes_through
from framework.parallel.mesh import PIPE
from framework.parallel.pipeline import ticks
from framework.units import tree_bytes as nbytes

_STATES: dict = {}


def executor_state(model: ModelConfig, parallel: ParallelConfig, batch: int, seq: int,
                   platform: str | None = None) -> dict:
    """`measure_executor_state`, once per distinct shape of the state (`state_key`): the
    planner asks for hundreds of layouts that share far fewer (one trace takes a third
    of a second here)."""
    platform = platform or jax.default_backend()
    through = passes_through(platform)
    lay = resolved(model, with_exchange(parallel, platform), seq, batch)
    key = state_key(lay) + (through,)
    if key not in _STATES:
        _STATES[key] = measure_executor_state(lay, through)
    return _STATES[key]


def state_key(lay: Layout) -> tuple:
    """Everything the shapes of the tick executor's state depend on: the model and the
    tensor-parallel plan (their per-device weights and activations), the chunks a rank
    holds and their layers (padded or not), a microbatch's rows and tokens, the buffer
    plan's slot counts, which buffers send overlapped, the backward's cells, and FSDP's
    sharding of the gradient accumulators, and the expert plan (the experts' weights and
    their gradient accumulators split over `expert`; the exchange's buffers among a
    layer's residuals), and collective matmul (its rings' blocks among the residuals).
    tests/unit/test_executor_state_key.py changes each ParallelConfig field alone: the
    key changes or the traced state does not."""
    prog, parallel = lay.program, lay.parallel
    s = prog.schedule
    pending = tuple(sorted({ch.buffer for ch in prog.buffers.channels if ch.overlap}))
    return (lay.model, parallel.tensor, parallel.context, parallel.sequence_parallel,
            parallel.collective_matmul, parallel.remat, tuple(parallel.tensor_split),
            s.n_chunks, lay.chunk_layers, lay.stage_layers is not None,
            lay.rows_per_microbatch, lay.seq_len, tuple(sorted(prog.buffers.n_slots.items())),
            pending, s.split_backward, s.parts,
            parallel.data if lay.gathers_per_use else None,  # FSDP: sharded grads
            parallel.expert, parallel.expert_exchange, parallel.expert_chunks)


def trace_per_device(lay: Layout, measure, pass_through: bool = True) -> None:
    """Traces `measure(fns, params, inputs, targets, docs)` inside the step's own
    per-device setup (`engine.step.device_fn`) in a `shard_map` over an abstract mesh of
    the layout's degrees, for a global batch of the layout's rows: `jax.eval_shape`, no
    devices, nothing compiled. `measure` records what it finds and returns a scalar."""
    specs, zero1_dims = param_specs(lay)
    shapes = abstract_train_params(lay.model, lay.parallel.pipeline, lay.chunks_per_rank,
                                   lay.stage_layers)
    tokens = jax.ShapeDtypeStruct((lay.global_batch, lay.seq_len + 1), jnp.int32)
    body = device_fn(lay, zero1_dims, measure, lay.program.schedule.split_backward,
                     StepOptions(pass_through=pass_through))
    jax.eval_shape(jax.shard_map(body, mesh=lay.abstract_mesh, in_specs=(specs, P(lay.batch_axes)),
                                 out_specs=P()), shapes, tokens)


def measure_executor_state(lay: Layout, pass_through: bool = True) -> dict:
    """Bytes per device of the tick executor's own state before its first tick (its
    `Carry`: receive slots, stash, saved, gradient accumulators, pending sends), by
    field, the accumulators a microbatch adds into (`accumulators`: the chunks', the
    head's; `framework/analysis/accumulation.py`), and of what a cell hands out of its
    conditional to be written after it (`slot`: F's fresh stash slot, where it is not
    written in place, and the saved buffers' entry). Measured, not recounted:
    `jax.eval_shape` of the executor's `initial_carry` (`trace_per_device`).
    `pass_through`: as the target's compiler (`engine.step.passes_through`: on GPUs the
    stash has a spare slot)."""
    found = {}

    def measure(fns, params, inputs, targets, docs):  # per device, at trace time only
        compute, like = ticks.compute_weights(fns, params)
        cells = ticks.make_cells(lay.program, fns, compute, inputs, targets,
                                 jax.lax.axis_index(PIPE))
        carry = ticks.initial_carry(cells, like)
        found.update({k: nbytes(v) for k, v in carry._asdict().items()})
        # (the chunks', the head's) accumulators a microbatch's backward adds into
        found["accumulators"] = accumulator_bytes(carry.grads, lay.model)
        found["weights"], found["weight_casts"] = step_weights.copy_bytes(compute, params)
        # F's residuals (and the weight ops' inputs a split backward without remat
        # keeps) leave its conditional as one fresh slot only where the compiler copies
        # what a conditional passes through; else each layer's are written in place.
        # (Under remat a split backward's B hands dy to W: one [mb, seq, d].)
        fresh = nbytes(cells.fresh_zeros()) if cells.apart else 0
        held = nbytes([cells.zeros(a, 0) for a in cells.types.saved]) if cells.recompute else 0
        found["slot"] = fresh + held
        return jnp.zeros(())

    trace_per_device(lay, measure, pass_through)
    return found


def accumulator_bytes(carry_grads: dict, model: ModelConfig) -> tuple[float, float]:
    """(the chunks', the head's) accumulator bytes of the tick executor's carry (the
    embedding's counted with the head's where the two are tied: the head's gradient
    is then added to the whole table)."""
    head = nbytes(carry_grads.get("head", {}))
    return nbytes(carry_grads["chunks"]), head + (nbytes(carry_grads.get("embed", {}))
                                                  if model.tie_embeddings else 0)
