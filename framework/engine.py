"""The 3D-parallel train step: one pure, jitted function (state, tokens) -> (state, metrics).

Layout of one step on the (pipe, data, tensor) mesh:
  1. a `shard_map` over all three axes runs on every device, with its shards of the
     parameters (laid out by `framework/sharding.py`) and its data replica's rows:
       - `device_params`: ZeRO-1's gather, and the per-device view of the weights;
       - the pipeline executor the schedule names (`framework/pipeline/`) runs the
         schedule table: each stage's layers, with Megatron's tensor-parallel
         collectives inside (`framework/tensor_parallel.py`), head + loss on the last
         stage, and returns this device's loss share and gradients;
       - `reduce_gradients`: each gradient once over `data` (`framework/data_parallel.py`),
         over `pipe` for the parameters several ranks use (embedding, head);
  2. outside it, AdamW updates the parameters with the optimizer state sharded like them.
Every collective is explicit, so the compiled program holds exactly the communication
written here (`framework/audit.py` lists it).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from framework import audit, data_parallel, sharding
from framework.config import ModelConfig, OptimConfig, ParallelConfig
from framework.model import (Embed, Head, apply_layers, cross_entropy_sum, init_params,
                             param_logical_axes)
from framework.optim import lr_schedule, make_optimizer
from framework.pipeline import StageFns, executor, layout
from framework.pipeline.autodiff import forward as forward_loss
from framework.pipeline.comm import varying
from framework.pipeline.schedule import Schedule, circular, make_schedule
from framework.tensor_parallel import TensorParallel

MANUAL = ("pipe", "data")  # replicated parameters are made per-device over these


@dataclasses.dataclass
class Engine:
    """Everything needed to run steps for one (model, parallel) configuration."""

    model: ModelConfig
    parallel: ParallelConfig
    mesh: jax.sharding.Mesh
    schedule: Schedule
    optimizer: optax.GradientTransformation
    lr: optax.Schedule
    param_specs: dict  # PartitionSpecs of the train-layout parameters
    zero1_dims: dict | None
    state_shardings: dict = None
    step_fn: object = None  # jitted (state, tokens) -> (state, metrics)
    compiled: object = None  # step_fn compiled for the run's shapes (see `compile`)

    def __post_init__(self):
        self.state_shardings = self._state_shardings()
        self.step_fn = self._jit_step()

    def _state_shardings(self):
        """Optimizer moments are sharded exactly like the parameters they track."""
        params = sharding.named(self.mesh, self.param_specs)
        replicated = NamedSharding(self.mesh, P())
        shapes = self.abstract_params()
        opt = optax.tree_map_params(self.optimizer, lambda _, sh: sh,
                                    jax.eval_shape(self.optimizer.init, shapes), params,
                                    transform_non_params=lambda _: replicated)
        return {"params": params, "opt_state": opt, "step": replicated}

    @property
    def n_chunks(self) -> int:
        return self.schedule.n_chunks

    def shard_params(self, canonical):
        """Canonical params (host or device) -> train layout, placed on the mesh."""
        params = layout.canonical_to_train(canonical, self.parallel.pipeline, self.n_chunks)
        return jax.device_put(params, self.state_shardings["params"])

    def canonical_params(self, params):
        return layout.train_to_canonical(params)

    def init_state(self, canonical):
        """Train state {params, opt_state, step} from canonical params, on the mesh."""
        params = self.shard_params(canonical)
        init = lambda p: {"params": p, "opt_state": self.optimizer.init(p),
                          "step": jnp.zeros((), jnp.int32)}
        return jax.jit(init, out_shardings=self.state_shardings)(params)

    def abstract_params(self):
        """Train-layout parameter shapes (jax.ShapeDtypeStruct leaves)."""
        return abstract_train_params(self.model, self.parallel.pipeline, self.n_chunks)

    def abstract_inputs(self, global_batch_size: int, seq_len: int):
        """(state, tokens) as ShapeDtypeStructs with this engine's shardings: enough to
        compile the step and read its memory and communication without allocating."""
        shapes = self.abstract_params()
        state = {"params": shapes, "opt_state": jax.eval_shape(self.optimizer.init, shapes),
                 "step": jax.ShapeDtypeStruct((), jnp.int32)}
        state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                             state, self.state_shardings)
        tokens = jax.ShapeDtypeStruct((global_batch_size, seq_len + 1), jnp.int32,
                                      sharding=self.batch_sharding())
        return state, tokens

    def loss_and_grads_fn(self):
        """Jitted (params, tokens) -> (loss, grads in train layout): the step without the
        optimizer, for parity tests and audits."""
        return jax.jit(build_loss_and_grads(self.model, self.parallel, self.mesh, self.schedule,
                                            self.param_specs, self.zero1_dims))

    def eval_loss_fn(self):
        """Jitted (params, tokens) -> mean loss, forward only (for eval/loss)."""
        fn = build_loss_and_grads(self.model, self.parallel, self.mesh, self.schedule,
                                  self.param_specs, self.zero1_dims, forward_only=True)
        return jax.jit(fn, in_shardings=(self.state_shardings["params"], self.batch_sharding()))

    def batch_sharding(self):
        return NamedSharding(self.mesh, P("data"))

    def shard_batch(self, tokens):
        return jax.device_put(tokens, self.batch_sharding())

    def _jit_step(self):
        loss_and_grads = build_loss_and_grads(self.model, self.parallel, self.mesh,
                                              self.schedule, self.param_specs, self.zero1_dims)

        def train_step(state, tokens):
            loss, grads = loss_and_grads(state["params"], tokens)
            updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            metrics = {"train/loss": loss, "train/grad_norm": optax.tree.norm(grads),
                       "train/lr": self.lr(state["step"])}
            return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

        return jax.jit(train_step, in_shardings=(self.state_shardings, self.batch_sharding()),
                       out_shardings=(self.state_shardings, None), donate_argnums=0)

    def compile(self, state, tokens) -> dict:
        """Compiles the step once for these shapes (later `step` calls reuse it) and
        returns what the compiled program says about itself (`audit.compiled_stats`:
        compile time, per-device memory, bytes per mesh axis)."""
        self.compiled, seconds = audit.timed_compile(self.step_fn, state, tokens)
        return {"perf/compile_time_s": seconds, **audit.compiled_stats(self, self.compiled)}

    def step(self, state, tokens):
        """One optimizer step; metrics stay on device (call `host_metrics` to read)."""
        fn = self.compiled if self.compiled is not None else self.step_fn
        return fn(state, tokens)

    def host_metrics(self, metrics) -> dict:
        out = {k: float(v) for k, v in metrics.items()}
        out["pipeline/bubble_fraction"] = self.schedule.formula_bubble
        out["pipeline/bubble_fraction_table"] = self.schedule.bubble_fraction
        return out


def build_engine(model: ModelConfig, parallel: ParallelConfig, optim: OptimConfig,
                 total_steps: int, mesh) -> Engine:
    """Assumes `parallel` was validated (framework.config.validate) for this mesh."""
    schedule = make_schedule(parallel.schedule, parallel.pipeline, parallel.microbatches,
                             parallel.virtual_stages)
    axes = layout.train_axes(param_logical_axes(model))
    specs = sharding.param_specs(axes)
    dims = None
    if parallel.zero1 and parallel.data > 1:
        shapes = abstract_train_params(model, parallel.pipeline, schedule.n_chunks)
        dims = data_parallel.zero1_dims(shapes, specs, parallel.data)
        specs = data_parallel.add_data_axis(specs, dims)
    return Engine(model, parallel, mesh, schedule, make_optimizer(optim, total_steps),
                  lr_schedule(optim, total_steps), specs, dims)


def abstract_train_params(model: ModelConfig, n_stages: int, n_chunks: int):
    """Train-layout parameter shapes (jax.ShapeDtypeStruct leaves); allocates nothing."""
    return jax.eval_shape(lambda: layout.canonical_to_train(
        init_params(model, jax.random.key(0)), n_stages, n_chunks))


# --- The per-device step, in named pieces ---------------------------------------------

def stage_fns(model: ModelConfig, parallel: ParallelConfig, tp: TensorParallel,
              n_tokens_global: int, split: bool) -> StageFns:
    """The model as the pipeline executors see it, on one device (`tp`: the tensor-
    parallel plan); the loss share of a microbatch is its token cross-entropy sum over
    the global token count."""

    def head_loss(head, embed, y, targets):
        logits = Head(model, tp).apply({"params": head}, y, tied_table=embed["table"])
        return cross_entropy_sum(logits, targets, tp) / n_tokens_global

    return StageFns(
        embed=lambda e, ids: Embed(model, tp).apply({"params": e}, ids),
        layers=partial(apply_layers, model, remat=parallel.remat, tp=tp),
        head_loss=head_loss,
        split=_split_layers(model, parallel.remat, tp) if split else None)


def _split_layers(model, remat, tp):
    from framework.model import split_layers

    return split_layers(model, remat=remat, tp=tp)


def device_params(params, zero1_dims, vary_over):
    """This device's weights for the step: ZeRO-1 shards gathered, typed per device (so
    that gradients are taken per device, without implicit sums), the layers viewed as
    this rank's chunks [v, Lc, ...]."""
    if zero1_dims is not None:
        params = data_parallel.gather_params(params, zero1_dims)
    params = jax.tree.map(lambda a: varying(a, vary_over), params)
    return {"embed": params["embed"], "head": params["head"],
            "chunks": jax.tree.map(lambda a: a[0], params["stages"])}  # drop the stage axis


def reduce_gradients(grads, tensor_replicated, sequence_parallel: bool, zero1_dims):
    """Each gradient reduced once: per-device chunks back to the stage layout; with
    sequence parallelism the norm scales' partial sums over `tensor`; the parameters
    several pipeline ranks use (embedding on the first, head on the last) over `pipe`;
    everything over `data` (or ZeRO-1's reduce-scatter)."""
    grads = {"embed": grads["embed"], "head": grads["head"],
             "stages": jax.tree.map(lambda a: a[None], grads["chunks"])}
    if sequence_parallel:
        grads = jax.tree.map(lambda g, r: jax.lax.psum(g, "tensor") if r else g,
                             grads, tensor_replicated)
    grads = {k: v if k == "stages" else jax.lax.psum(v, "pipe") for k, v in grads.items()}
    return data_parallel.reduce_gradients(grads, zero1_dims)


def build_loss_and_grads(model: ModelConfig, parallel: ParallelConfig, mesh,
                         schedule: Schedule, param_specs, zero1_dims, forward_only=False):
    """(params, tokens) -> (mean loss, gradients), or with `forward_only` the mean loss."""
    m, sp = parallel.microbatches, parallel.sequence_parallel and parallel.tensor > 1
    # The tensor-parallel plan from the sharding rules: a rule the model cannot run is a
    # PlanError here, when the engine is built.
    tp = TensorParallel("tensor", parallel.tensor, parallel.sequence_parallel)
    # Parameters not sharded over `tensor` (norm scales). Without sequence parallelism
    # every tensor device computes their full gradient from identical activations; with
    # it each device sees its slice of the sequence, so they are summed over `tensor`.
    tensor_replicated = jax.tree.map(lambda s: "tensor" not in s, param_specs,
                                     is_leaf=lambda s: isinstance(s, P))
    vary_over = MANUAL + (("tensor",) if parallel.sequence_parallel else ())

    def split_batch(tokens):  # [b, seq + 1] -> inputs, targets [micro, b / micro, seq]
        mb = lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:])
        n_tokens_global = tokens.shape[0] * parallel.data * (tokens.shape[1] - 1)
        return mb(tokens[:, :-1]), mb(tokens[:, 1:]), n_tokens_global

    def eval_body(params, tokens):
        inputs, targets, n_tokens = split_batch(tokens)
        fns = stage_fns(model, parallel, tp, n_tokens, split=False)
        # Forward only: the GPipe forward over the same chunks (nothing to interleave).
        table = schedule if schedule.executor == "autodiff" else circular(
            schedule.n_stages, m, schedule.n_chunks)
        loss = forward_loss(table, fns, device_params(params, zero1_dims, vary_over),
                            inputs, targets)
        return jax.lax.psum(loss, MANUAL)

    def body(params, tokens):
        """Runs on each device: params are its shards, tokens its data replica's rows."""
        inputs, targets, n_tokens = split_batch(tokens)
        fns = stage_fns(model, parallel, tp, n_tokens, split=schedule.split_backward)
        loss, grads = executor(schedule).loss_and_grads(
            schedule, fns, device_params(params, zero1_dims, vary_over), inputs, targets)
        grads = reduce_gradients(grads, tensor_replicated, sp, zero1_dims)
        return jax.lax.psum(loss, MANUAL), grads

    if forward_only:
        return jax.shard_map(eval_body, mesh=mesh, in_specs=(param_specs, P("data")),
                             out_specs=P())
    return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, P("data")),
                         out_specs=(P(), param_specs))
