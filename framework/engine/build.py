"""The engine: everything needed to run and inspect steps of one (model, parallel)
configuration on one mesh, built once per run.

`build_engine` picks the schedule table, lays out the train state (`StateLayout`,
`framework/engine/state.py`) and jits the pure step (`framework/engine/step.py`). The
engine compiles that step once for the run's shapes (`compile`), runs it (`step`), and
gives the forward-only loss for evaluation and the bare (loss, gradients) function for
the parity tests. It holds no training loop (`framework/run/loop.py`) and reads no
statistics of its program (`framework/analysis/`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from framework.config import ModelConfig, OptimConfig, ParallelConfig
from framework.errors import ConfigError
from framework.engine.optim import lr_schedule, make_optimizer
from framework.engine.state import StateLayout, param_specs
from framework.engine.step import (build_loss_and_grads, fp8_metrics, probe_metrics,
                                   stats_update, train_step)
from framework.model import attention, fp8_delayed
from framework.model.documents import DocumentMask
from framework.parallel.mesh import batch_axes
from framework.parallel.pipeline import layout
from framework.engine.resolved import resolved, with_exchange
from framework.parallel.pipeline.program import Program
from framework.parallel.pipeline.table import Schedule


@dataclass(eq=False)
class Engine:
    """The jitted step of one configuration on one mesh, and its state's layout."""

    layout: StateLayout
    program: Program  # the schedule compiled once (framework/parallel/pipeline/program.py)
    lr: optax.Schedule
    z_loss: float = 0.0  # the training loss's z-loss weight (optim.z_loss)
    documents: DocumentMask | None = None  # data.document_mask (framework/model/documents.py)
    step_fn: object = None  # jitted (state, tokens) -> (state, metrics)
    compiled: object = None  # step_fn compiled for the run's shapes (see `compile`)
    compile_s: float = 0.0  # the seconds that took
    # model.fp8=delayed: the step that fills empty histories (current scaling), and
    # whether `step` still has to look at the state's (framework/model/fp8_delayed.py)
    filling_fn: object = None
    histories_unseen: bool = False

    def __post_init__(self):
        self.step_fn = self._jitted_step()
        if self.model.fp8 == "delayed":
            self.filling_fn, self.histories_unseen = self._jitted_step(current=True), True

    def _jitted_step(self, current: bool = False):
        lay = self.layout.resolved
        return jax.jit(
            train_step(self._loss_and_grads(probes="filling" if current else "step"),
                       self.optimizer,
                       self.lr, fp8_metrics(lay), probe_metrics(lay), stats_update(lay)),
            in_shardings=(self.state_shardings, self.batch_sharding()),
            out_shardings=(self.state_shardings, None), donate_argnums=0)

    # The configuration and the layout, as the rest of the framework reads them.
    model = property(lambda self: self.layout.model)
    parallel = property(lambda self: self.layout.parallel)
    mesh = property(lambda self: self.layout.mesh)
    optimizer = property(lambda self: self.layout.optimizer)
    param_specs = property(lambda self: self.layout.param_specs)
    zero1_dims = property(lambda self: self.layout.zero1_dims)
    state_shardings = property(lambda self: self.layout.shardings)
    n_chunks = property(lambda self: self.layout.n_chunks)

    @property
    def schedule(self) -> Schedule:
        """The program's table."""
        return self.program.schedule

    def _loss_and_grads(self, forward_only: bool = False, probes: str = "none"):
        return build_loss_and_grads(self.layout.resolved, self.mesh, self.param_specs,
                                    self.zero1_dims, forward_only,
                                    0.0 if forward_only else self.z_loss, self.documents,
                                    probes)

    def shard_params(self, canonical):
        """Canonical params (host or device) -> train layout, placed on the mesh."""
        return self.layout.place(canonical)

    def canonical_params(self, params):
        return layout.train_to_canonical(params, self.layout.v_shape, self.layout.stage_layers)

    def init_state(self, canonical):
        """Train state {params, opt_state, step} from canonical params, on the mesh."""
        return self.layout.init(self.layout.place(canonical))

    def abstract_params(self):
        """Train-layout parameter shapes (jax.ShapeDtypeStruct leaves)."""
        return self.layout.abstract_params

    def abstract_inputs(self, global_batch_size: int, seq_len: int):
        """(state, tokens) as ShapeDtypeStructs with this engine's shardings: enough to
        compile the step and read its memory and communication without allocating."""
        tokens = jax.ShapeDtypeStruct((global_batch_size, seq_len + 1), jnp.int32,
                                      sharding=self.batch_sharding())
        return self.layout.abstract_state(), tokens

    def loss_and_grads_fn(self):
        """Jitted (params, tokens) -> (loss, grads in train layout): the step without the
        optimizer, for parity tests and audits."""
        return jax.jit(self._loss_and_grads())

    def eval_loss_fn(self):
        """Jitted (params, tokens) -> mean loss, forward only (for eval/loss)."""
        return jax.jit(self._loss_and_grads(forward_only=True),
                       in_shardings=(self.state_shardings["params"], self.batch_sharding()))

    def attention_kernel(self, seq_len: int) -> str:
        """The attention kernel the step runs for sequences of `seq_len` (`auto` was
        resolved for the mesh's platform when built: what is left picks by length)."""
        return attention.kernel_for(self.model, seq_len, "host")

    def batch_sharding(self):
        return NamedSharding(self.mesh, P(batch_axes(self.parallel)))

    def shard_batch(self, tokens):
        return jax.device_put(tokens, self.batch_sharding())

    def compile(self, state, tokens) -> float:
        """Compiles the step once for these shapes and shardings (arrays or
        ShapeDtypeStructs; later `step` calls reuse it, later `compile` calls return at
        once); returns the seconds it took to obtain the executable (from JAX's cache
        or not)."""
        if self.compiled is None:
            start = time.perf_counter()
            self.compiled = self.step_fn.lower(state, tokens).compile()
            self.compile_s = time.perf_counter() - start
        return self.compile_s

    def step(self, state, tokens):
        """One optimizer step; metrics stay on device (call `host_metrics` to read).
        With `model.fp8=delayed`, the first step of a state whose histories are empty
        (fresh, or restored from a run without them) scales currently and fills them."""
        if self.histories_unseen:
            self.histories_unseen = False
            if fp8_delayed.empty(state["params"]["stages"]):
                return self.filling_fn(state, tokens)
        fn = self.compiled if self.compiled is not None else self.step_fn
        return fn(state, tokens)

    def host_metrics(self, metrics) -> dict:
        out = {k: float(v) for k, v in metrics.items()}
        out["pipeline/bubble_fraction"] = self.schedule.formula_bubble
        out["pipeline/bubble_fraction_table"] = self.schedule.bubble_fraction
        return out


def build_engine(model: ModelConfig, parallel: ParallelConfig, optim: OptimConfig,
                 total_steps: int, mesh, documents: DocumentMask | None = None) -> Engine:
    """Assumes `parallel` was validated (framework/engine/validate.py) for this mesh.
    `documents`: attention within each row's documents (data.document_mask)."""
    if model.moe.bias_update_rate and optim.param_dtype != "float32":
        raise ConfigError(f"model.moe.bias_update_rate={model.moe.bias_update_rate} needs "
                          f"optim.param_dtype=float32 (the balancing bias moves by that much "
                          f"a step; {optim.param_dtype} would round the steps away)")
    # `auto` attention as the mesh's platform runs it (a GPU target compiled from a CPU
    # machine: cuDNN's kernel, as the run will use)
    platform = mesh.devices.flat[0].platform
    model = attention.for_platform(model, platform, documents is not None)
    # the expert exchange the platform's compiler runs (ragged on TPU and GPU)
    parallel = with_exchange(parallel, platform)
    lay = resolved(model, parallel)
    specs, dims = param_specs(lay)
    state = StateLayout(lay, mesh, make_optimizer(optim, total_steps), specs, dims,
                        optim.param_dtype)
    return Engine(state, lay.program, lr_schedule(optim, total_steps), optim.z_loss, documents)
