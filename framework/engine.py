"""The 3D-parallel train step: one pure, jitted function (state, tokens) -> (state, metrics).

Layout of one step on the (pipe, data, tensor) mesh:
  1. a `shard_map` over all three axes runs on every device, with its shards of the
     parameters (laid out by `framework/sharding.py`) and its data replica's rows:
       - embed the rows, split them into microbatches,
       - run the pipeline schedule (`framework/pipeline/`): each stage's layers, with
         Megatron's tensor-parallel collectives inside (`framework/tensor_parallel.py`),
         head + loss on the last rank,
       - differentiate that locally, then reduce each gradient once: over `data`
         (`framework/data_parallel.py`), and over `pipe` for the parameters several
         ranks use (embedding, head);
  2. outside it, AdamW updates the parameters with the optimizer state sharded like them.
Every collective is explicit, so the compiled program holds exactly the communication
written here (`framework/audit.py` lists it).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from framework import audit, data_parallel, sharding
from framework.config import ModelConfig, OptimConfig, ParallelConfig
from framework.model import (Embed, Head, apply_layers, cross_entropy_sum, init_params,
                             param_logical_axes)
from framework.optim import lr_schedule, make_optimizer
from framework.pipeline import layout
from framework.pipeline.executor import ON_FIRST, ON_LAST, SEND, STAGE, only_on, run_forward, varying
from framework.pipeline.one_f_one_b import (BACKWARD as F1B_BACKWARD, FORWARD as F1B_FORWARD,
                                             SEND_BACKWARD, SEND_FORWARD, run_1f1b)
from framework.pipeline.schedule import BWD, FWD, Schedule, make_schedule
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
    _compiled: object = None  # step_fn compiled for the run's shapes (see `compile`)

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
        """Jitted (params, tokens) -> (loss, grads in train layout, useful ticks): the
        step without the optimizer, for parity tests and audits."""
        fn = build_loss_and_grads(self.model, self.parallel, self.mesh, self.schedule,
                                  self.param_specs, self.zero1_dims)
        return jax.jit(fn)

    def eval_loss_fn(self):
        """Jitted (params, tokens) -> mean loss, forward only (for eval/loss). 1F1B
        evaluates with the GPipe forward: without a backward there is nothing to
        interleave."""
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
            loss, grads, useful = loss_and_grads(state["params"], tokens)
            updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            metrics = {
                "train/loss": loss,
                "train/grad_norm": optax.tree.norm(grads),
                "train/lr": self.lr(state["step"]),
                "pipeline/useful_ticks": useful,
            }
            return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

        return jax.jit(train_step, in_shardings=(self.state_shardings, self.batch_sharding()),
                       out_shardings=(self.state_shardings, None), donate_argnums=0)

    def compile(self, state, tokens) -> dict:
        """Compiles the step once for these shapes (later `step` calls reuse it) and
        returns what the compiled program says about itself: compile time, per-device
        memory (XLA's memory analysis) and bytes sent per device per step on each mesh
        axis (the communication audit)."""
        start = time.perf_counter()
        self._compiled = self.step_fn.lower(state, tokens).compile()
        stats = {"perf/compile_time_s": time.perf_counter() - start}
        mem = self._compiled.memory_analysis()
        if mem is not None:
            # Arguments + outputs + temporaries, donated (aliased) buffers counted once:
            # everything XLA's buffer assignment holds at the step's high-water mark.
            stats["memory/peak_bytes_per_device"] = int(
                mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                - mem.alias_size_in_bytes)
            stats["memory/temp_bytes_per_device"] = int(mem.temp_size_in_bytes)
            stats["memory/argument_bytes_per_device"] = int(mem.argument_size_in_bytes)
        found = self.collectives(self._compiled.as_text())
        for axis, nbytes in audit.bytes_per_axis(found, dict(self.mesh.shape)).items():
            stats[f"comm/bytes_per_step/{axis}"] = float(nbytes)
        return stats

    def collectives(self, hlo: str) -> list:
        """The communication audit of a compiled program of this engine."""
        return audit.collectives(hlo, dict(self.mesh.shape), self.scope_weights())

    def scope_weights(self) -> dict[str, float]:
        """How often the conditionally executed scopes run, from the schedule table."""
        table, p = self.schedule, self.schedule.n_stages
        weights = {ON_FIRST: 1 / p, ON_LAST: 1 / p}
        if table.backward_by_autodiff:
            rows = table.executed_rows()
            weights[SEND] = float(rows.sends(FWD).mean())
            weights[STAGE] = float((rows.action == FWD).mean())
        else:  # 1F1B: per-tick branches of the tick loop
            weights[F1B_FORWARD] = float((table.action == FWD).mean())
            weights[F1B_BACKWARD] = float((table.action == BWD).mean())
            weights[SEND_FORWARD] = float(table.sends(FWD).mean())
            weights[SEND_BACKWARD] = float(table.sends(BWD).mean())
        return weights

    def step(self, state, tokens):
        """One optimizer step; metrics stay on device (call `host_metrics` to read)."""
        fn = self._compiled if self._compiled is not None else self.step_fn
        return fn(state, tokens)

    def host_metrics(self, metrics) -> dict:
        out = {k: float(v) for k, v in metrics.items() if k != "pipeline/useful_ticks"}
        out["pipeline/bubble_fraction"] = self.schedule.formula_bubble
        out["pipeline/bubble_fraction_measured"] = measured_bubble(
            self.schedule, np.asarray(metrics["pipeline/useful_ticks"]))
        return out


def idle_stage_ticks(schedule: Schedule, useful_per_stage) -> int:
    """Idle stage-ticks of the whole step, from the executor's per-stage counters of
    ticks that processed a real microbatch. Autodiff schedules count their forward
    ticks; autodiff replays exactly those ticks backwards, so both halves idle alike."""
    executed = schedule.executed_rows().n_ticks * schedule.n_stages
    idle = executed - int(np.sum(useful_per_stage))
    return 2 * idle if schedule.backward_by_autodiff else idle


def measured_bubble(schedule: Schedule, useful_per_stage) -> float:
    """1 - useful stage-ticks / executed stage-ticks (both halves of the step)."""
    total = schedule.n_ticks * schedule.n_stages
    return idle_stage_ticks(schedule, useful_per_stage) / total


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


def build_loss_and_grads(model: ModelConfig, parallel: ParallelConfig, mesh,
                         schedule: Schedule, param_specs, zero1_dims, forward_only=False):
    """(params, tokens) -> (mean loss, gradients, useful ticks per stage), or with
    `forward_only` just the mean loss."""
    m, p = parallel.microbatches, parallel.pipeline
    tp = TensorParallel("tensor", parallel.tensor, parallel.sequence_parallel)
    stage_fn = partial(apply_layers, model, remat=parallel.remat, tp=tp)
    embed_fn = lambda e, ids: Embed(model, tp).apply({"params": e}, ids)

    def head_loss_fn(head, embed, y, targets, n_tokens_global):
        logits = Head(model, tp).apply({"params": head}, y, tied_table=embed["table"])
        return cross_entropy_sum(logits, targets, tp) / n_tokens_global

    def microbatches(a):  # [b, ...] -> [micro, b / micro, ...]
        return a.reshape((m, a.shape[0] // m) + a.shape[1:])

    def autodiff_loss(params, tokens, n_tokens_global, schedule=schedule):
        """GPipe / circular: this device's share of the mean loss (nonzero on the last
        rank); its gradient is taken by autodiff through the whole tick loop."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # [b, seq]
        rank = jax.lax.axis_index("pipe")
        first, last = (rank == 0, rank == p - 1) if p > 1 else (True, True)
        b, seq = inputs.shape
        seq_local = seq // parallel.tensor if tp.sequence_parallel else seq
        x = only_on(ON_FIRST, first, lambda: embed_fn(params["embed"], inputs),
                    lambda: zeros((b, seq_local, model.d_model), jnp.dtype(model.dtype)))
        chunks = jax.tree.map(lambda a: a[0], params["stages"])  # drop the stage axis
        outputs, useful = run_forward(schedule, stage_fn, chunks, microbatches(x))
        # outputs: [micro, mb, seq(/tensor), embed], meaningful on the last rank.
        loss = only_on(ON_LAST, last, lambda: head_loss_by_microbatch(
            params["head"], params["embed"], outputs, microbatches(targets), n_tokens_global),
            lambda: zeros((), jnp.float32, MANUAL))
        return loss, useful

    def head_loss_by_microbatch(head, embed, y_mb, targets_mb, n_tokens_global):
        """Head + loss one microbatch at a time, recomputed in the backward, so only one
        microbatch's [mb, seq, vocab/tensor] logits are ever alive (not the batch's)."""
        if m == 1:  # the whole batch is one microbatch: nothing to save by recomputing
            return head_loss_fn(head, embed, y_mb[0], targets_mb[0], n_tokens_global)
        one = jax.checkpoint(lambda y, t: head_loss_fn(head, embed, y, t, n_tokens_global))
        total, _ = jax.lax.scan(lambda acc, yt: (acc + one(*yt), None),
                                zeros((), jnp.float32, MANUAL), (y_mb, targets_mb))
        return total

    def value_and_grad(params, tokens, n_tokens_global):
        if schedule.backward_by_autodiff:
            return jax.value_and_grad(autodiff_loss, has_aux=True)(params, tokens, n_tokens_global)
        # 1F1B: the tick loop computes the gradients itself.
        local = {"embed": params["embed"], "head": params["head"],
                 "chunk": jax.tree.map(lambda a: a[0, 0], params["stages"])}
        loss, g, useful = run_1f1b(
            schedule, stage_fn, embed_fn,
            lambda h, e, y, t: head_loss_fn(h, e, y, t, n_tokens_global),
            local, microbatches(tokens[:, :-1]), microbatches(tokens[:, 1:]))
        grads = {"embed": g["embed"], "head": g["head"],
                 "stages": jax.tree.map(lambda a: a[None, None], g["chunk"])}
        return (loss, useful), grads

    # Parameters not sharded over `tensor` (norm scales). Without sequence parallelism
    # every tensor device computes their full gradient from identical activations; with
    # it each device sees its slice of the sequence, so they are summed over `tensor`.
    tensor_replicated = jax.tree.map(lambda s: "tensor" not in s, param_specs,
                                     is_leaf=lambda s: isinstance(s, P))
    vary_over = MANUAL + (("tensor",) if tp.sequence_parallel else ())

    def zeros(shape, dtype, axes=vary_over):  # typed like the activations they stand for
        return varying(jnp.zeros(shape, dtype), axes)

    def eval_body(params, tokens):
        n_tokens_global = tokens.shape[0] * parallel.data * (tokens.shape[1] - 1)
        if zero1_dims is not None:
            params = data_parallel.gather_params(params, zero1_dims)
        params = jax.tree.map(lambda a: varying(a, vary_over), params)
        forward = schedule if schedule.backward_by_autodiff else make_schedule("gpipe", p, m)
        loss, _ = autodiff_loss(params, tokens, n_tokens_global, forward)
        return jax.lax.psum(loss, MANUAL)

    if forward_only:
        return jax.shard_map(eval_body, mesh=mesh, in_specs=(param_specs, P("data")), out_specs=P())

    def body(params, tokens):
        """Runs on each device: params are its shards, tokens its data replica's rows."""
        n_tokens_global = tokens.shape[0] * parallel.data * (tokens.shape[1] - 1)
        if zero1_dims is not None:
            params = data_parallel.gather_params(params, zero1_dims)
        # Differentiate per device (no implicit sums), then reduce each gradient once.
        params = jax.tree.map(lambda a: varying(a, vary_over), params)
        (loss, useful), grads = value_and_grad(params, tokens, n_tokens_global)
        if tp.sequence_parallel:
            grads = jax.tree.map(lambda g, r: jax.lax.psum(g, "tensor") if r else g,
                                 grads, tensor_replicated)
        # Stage parameters live on one rank; the others are used on several ranks
        # (embedding on rank 0, head on the last, both when tied): sum over `pipe`.
        grads = {k: v if k == "stages" else jax.lax.psum(v, "pipe") for k, v in grads.items()}
        grads = data_parallel.reduce_gradients(grads, zero1_dims)
        return jax.lax.psum(loss, MANUAL), grads, useful[None]

    return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, P("data")),
                         out_specs=(P(), param_specs, P("pipe")))
