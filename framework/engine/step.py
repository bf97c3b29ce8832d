"""The parallel train step, in named pieces: one pure function
(state, tokens) -> (state, metrics) that `framework/engine/build.py` jits.

Layout of one step on the (pipe, data, context, tensor) mesh:
  1. a `shard_map` over all four axes runs on every device, with its shards of the
     parameters (laid out by `framework/parallel/rules.py`) and its data replica's rows
     (its two chunks of their sequence under context parallelism):
       - `device_params`: ZeRO-1's gather, and the per-device view of the weights;
       - the pipeline executor the schedule names (`framework/parallel/pipeline/`) runs
         the schedule table: each stage's layers, with Megatron's tensor-parallel
         collectives inside (`framework/parallel/tensor.py`), head + loss on the last
         stage, and returns this device's loss share and gradients;
       - `reduce_gradients`: each gradient once over `data` (`framework/parallel/data.py`),
         over `pipe` for the parameters several ranks use (embedding, head), over
         `context` (each device saw its part of every sequence);
  2. outside it, AdamW updates the parameters with the optimizer state sharded like them.
Every collective is explicit, so the compiled program holds exactly the communication
written here (`framework/analysis/audit.py` lists it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from framework import hardware
from framework.config import ModelConfig
from framework.engine import fp8_gathers, moe_stats, step_weights
from framework.engine import probes as probe_kinds
from framework.engine.resolved import Layout
from framework.engine.split import check_weight_ops, split_layers
from framework.engine.state import train_state
from framework.model import fp8, fp8_delayed, fp8_stats
from framework.model.documents import DocumentMask, documents_of
from framework.model.prefix import DENSE, embed_piece, prefix_layers, table_of
from framework.model.registry import spec_of
from framework.parallel import data as data_parallel
from framework.parallel.context import ContextParallel
from framework.parallel.expert import expert_parallel
from framework.parallel.mesh import CONTEXT, PIPE, TENSOR
from framework.parallel.pipeline import autodiff, ticks
from framework.parallel.pipeline.comm import manual_axes, varying, zeros_typed_like
from framework.parallel.pipeline.program import forward_program
from framework.parallel.pipeline.stage import StageFns, skip_unless
from framework.parallel.rules import is_expert_leaf, param_rules
from framework.parallel.tensor import TensorParallel


@dataclass(frozen=True)
class StepOptions:
    """How the step is traced beyond its layout: `z_loss` the training loss's z-loss
    weight (optim.z_loss); `documents` attention within each row's documents
    (data.document_mask); `cpu` the mesh's devices are CPUs (the collective matmul's
    rings shift by all-gather there, framework/parallel/tensor.py); `pass_through` the
    compiler keeps a conditional's pass-through in place (`passes_through`)."""

    z_loss: float = 0.0
    documents: DocumentMask | None = None
    cpu: bool = False
    pass_through: bool = True


def stage_fns(layout: Layout, tp: TensorParallel, n_tokens_global: int, split: bool,
              per_use=None, options: StepOptions = StepOptions()) -> StageFns:
    """The model as the pipeline executors see it, on one device (`tp`: the tensor-
    parallel plan); the loss share of a microbatch is its token cross-entropy sum over
    the global token count. `per_use`: FSDP's dimension per leaf when every use gathers
    its weights (the stored layout: stages [stage, chunk, layer, ...]); None: the
    weights arrive whole."""
    model, z_loss, spec = layout.model, options.z_loss, spec_of(layout.model)
    gather = _per_use_gathers(per_use, model.dtype)
    # the layers (the stack and the split backward's passes) gather matrices as FP8
    layer = fp8_gathers.layer_gather(per_use, model, tp.weight_max) or gather["layer"]
    if model.moe.enabled:  # the layers' statistics probe passes FSDP's gathers by
        gather = dict(gather, layer=moe_stats.without_probe(gather["layer"]))
        layer = moe_stats.without_probe(layer)
    stack_gather = fp8_gathers.on_params(layer)

    def head_loss(head, embed, y, targets):
        return spec.head_loss(model, tp, head, embed["table"], y, targets, z_loss) \
            / n_tokens_global

    if per_use is not None:  # the head's gathered weights: gathered again for its backward
        plain = head_loss  # (never saved: the weight matmuls' outputs only, as a layer's)
        run = spec.checkpointed(lambda y, weights, targets: plain(*weights, y, targets),
                           "save_dots", lambda weights: (gather["head"](weights[0]),
                                                         gather["embed"](weights[1])))
        head_loss = lambda head, embed, y, targets: run(y, (head, embed), targets)

    stack = spec.stack(layout.layer_remat, tp, skip_unless, stack_gather)
    # the embedding, then a MoE model's dense prefix (framework/model/prefix.py)
    piece = embed_piece(model, tp, spec.embed, spec.apply_layers,
                        spec.stack(layout.layer_remat, tp, None, gather["prefix"]))
    return StageFns(
        embed=lambda e, ids, docs=None: piece(gather["embed"](e), ids, docs),
        layers=partial(spec.apply_layers, model, stack=stack),
        head_loss=head_loss,
        split=split_layers(model, layout.layer_remat, layout.remat.keeps_inputs_only, tp=tp,
                           skip=skip_unless, gather=stack_gather) if split else None,
        weights=step_weights.once_a_step(model, tp.weight_max, per_use),
        pass_through=options.pass_through,
        embed_rows=embed_rows(model, tp) if per_use is None and not prefix_layers(model) else None)


def embed_rows(model: ModelConfig, tp: TensorParallel) -> tuple:
    """The embedding's gradient in two halves (`StageFns.embed_rows`): the looked-up
    rows' gradient from dx (through the embedding's cast, scale and tensor-parallel
    sum or scatter: a tap of zeros added to the rows, typed as they are), then their
    scatter-add into the table's slice (`llama.lookup_rows`' VJP, linear)."""
    module = spec_of(model).embed(model, tp)
    lookup_rows = type(module).rows

    def rows(embed, ids, dx):  # -> [mb, seq, d] in the table's dtype
        like = jax.eval_shape(lambda: lookup_rows(embed["table"], ids, tp))
        tap = zeros_typed_like(like, also=like.manual_axis_type.varying)
        run = lambda t: module.apply({"params": table_of(embed)}, ids, tap=t)
        return jax.vjp(run, tap)[1](dx)[0]

    def table(embed, ids, got):
        g = jax.vjp(lambda t: lookup_rows(t, ids, tp), embed["table"])[1](got)[0]
        return dict(jax.tree.map(jnp.zeros_like, embed), table=g)

    return rows, table


def _per_use_gathers(dims, dtype) -> dict:
    """FSDP's gathers of one use of the embedding, the head and a layer (identities,
    and no layer gather, without per-use gathers). The layers' and the head's matrices
    travel in the compute dtype `dtype` where it is narrower than the stored one (the
    model casts every matrix to it before use, framework/model/llama.py); the embedding
    table in its own (a lookup's gradient scatter-adds rows: summed in the stored
    dtype, as without FSDP). A MoE model's dense prefix (embed/dense, prefix.py) is
    gathered as the layers are, one layer at a time in the compute dtype ("prefix"),
    not with the embedding."""
    if dims is None:
        return {"embed": lambda tree: tree, "head": lambda tree: tree, "layer": None,
                "prefix": None}
    one = lambda tree, offset, cast=None: partial(
        data_parallel.gather_leaves, dims=tree, offset=offset, dtype=cast)
    embed, prefix = dict(dims["embed"]), None
    if DENSE in embed:  # (its leaves passed through by the embedding's gather)
        prefix = one(embed[DENSE], 1, dtype)
        embed[DENSE] = jax.tree.map(lambda d: None, embed[DENSE], is_leaf=lambda d: d is None)
    return {"embed": one(embed, 0), "head": one(dims["head"], 0, dtype),
            "layer": one(dims["stages"], 3, dtype), "prefix": prefix}


def device_params(params, gather, vary_over):
    """This device's weights for the step: ZeRO-1's shards gathered (`gather`, from
    `fp8_gathers.step_gather`; None: nothing to gather, or FSDP per use, whose `stage_fns` gather),
    typed per device (so that gradients are taken per device, without implicit sums),
    the layers viewed as this rank's chunks [v, Lc, ...]."""
    if gather is not None:
        params = gather(params)
    params = jax.tree.map(lambda a: varying(a, vary_over), params)
    return {"embed": params["embed"], "head": params["head"],
            "chunks": jax.tree.map(lambda a: a[0], params["stages"])}  # drop the stage axis


def reduce_gradients(grads, tensor_replicated, sequence_parallel: bool, zero1_dims,
                     per_use: bool = False, context: int = 1, expert_leaves=None):
    """Each gradient reduced once: per-device chunks back to the stage layout; with
    sequence parallelism the norm scales' partial sums over `tensor`; the parameters
    several pipeline ranks use (embedding on the first, head on the last) over `pipe`;
    everything over `data` (or ZeRO-1's reduce-scatter; FSDP per use: done by the
    gathers' transposes); with expert parallelism (`expert_leaves`, a bool per leaf)
    the dense leaves over `expert` too."""
    grads = {"embed": grads["embed"], "head": grads["head"],  # (FP8 gathers' scales: none)
             "stages": jax.tree.map(lambda a: a[None], fp8.params_of(grads["chunks"]))}
    if sequence_parallel:
        grads = jax.tree.map(lambda g, r: jax.lax.psum(g, TENSOR) if r else g,
                             grads, tensor_replicated)
    grads = {k: v if k == "stages" else jax.lax.psum(v, PIPE) for k, v in grads.items()}
    return data_parallel.reduce_gradients(grads, zero1_dims, reduced=per_use,
                                          also=(CONTEXT,) if context > 1 else (),
                                          expert_leaves=expert_leaves)


def split_batch(tokens, microbatches: int, data: int, cp: ContextParallel = ContextParallel(),
                documents: DocumentMask | None = None):
    """This replica's rows [b, seq + 1] -> (inputs, targets) [micro, b / micro, seq
    (/context: this device's chunks)], the global token count, and the document masks
    (`documents`; None without): their segment ids over the whole sequence [micro,
    b / micro, seq] (the ring cuts them by chunk), positions like inputs."""
    rows = lambda a: a.reshape((microbatches, a.shape[0] // microbatches) + a.shape[1:])
    mb = lambda a: cp.split(rows(a))
    inputs = mb(tokens[:, :-1])
    docs = documents_of(rows(tokens[:, :-1]), documents, cp.split)
    # typed like the inputs (a residual of every layer: the stash keeps it by type)
    docs = jax.tree.map(lambda a: varying(a, manual_axes(inputs)), docs)
    return inputs, mb(tokens[:, 1:]), tokens.shape[0] * data * (tokens.shape[1] - 1), docs


def passes_through(platform: str) -> bool:
    """Whether the compiler for `platform` of this process's jaxlib keeps a buffer that a
    conditional passes through in place (`StageFns.pass_through`; the device
    catalogue's compiler trait, `framework/hardware.py`)."""
    import jaxlib

    return hardware.passes_through(platform, jaxlib.__version__)


def tensor_parallel(layout: Layout, **run) -> TensorParallel:
    """The layout's tensor-parallel plan: its degree, sequence parallelism, rules,
    collective matmul and expert plan, read here only (the step's and the memory
    model's traced residuals, framework/analysis/residuals.py). `run`: what only a
    running step sets (the rings' permute, the context split, the statistics' axes)."""
    parallel = layout.parallel
    ep = expert_parallel(layout.expert, parallel.expert_exchange, parallel.expert_chunks)
    return TensorParallel(TENSOR, parallel.tensor, layout.sequence_parallel,
                          param_rules(parallel.tensor_split, layout.expert),
                          collective_matmul=parallel.collective_matmul, expert=ep, **run)


def device_fn(layout: Layout, zero1_dims, run, split: bool,
              options: StepOptions = StepOptions()):
    """(params, tokens) -> run(fns, params, inputs, targets, docs) on each device, inside the
    step's `shard_map`: the per-device setup every use of the executors shares (the
    model as `StageFns`, ZeRO-1's gather and the per-device weights, this replica's
    microbatches). The step runs the executor in it; the memory model traces the
    executor's state in it (`framework/analysis/executor_state.py`)."""
    parallel = layout.parallel
    # The tensor-parallel plan from the sharding rules: a rule the model cannot run is a
    # PlanError here, when the engine is built.
    cp = ContextParallel(CONTEXT, parallel.context, permute=not options.cpu)
    tp = tensor_parallel(layout, permute=not options.cpu, context=cp,
                         stat_axes=layout.microbatch_axes, groups=layout.microbatch_groups)
    if split:
        check_weight_ops(layout.model)

    per_use = zero1_dims if layout.gathers_per_use else None
    gather = None if zero1_dims is None or per_use is not None else \
        fp8_gathers.step_gather(zero1_dims, layout.model, tp.weight_max)

    def body(params, tokens):
        """Runs on each device: params are its shards, tokens its data replica's rows."""
        inputs, targets, n_tokens, docs = split_batch(tokens, parallel.microbatches,
                                                      parallel.data, cp, options.documents)
        fns = stage_fns(layout, tp, n_tokens, split=split, per_use=per_use, options=options)
        return run(fns, device_params(params, gather, layout.vary_over), inputs, targets, docs)

    return body


def build_loss_and_grads(layout: Layout, mesh, param_specs, zero1_dims, forward_only=False,
                         z_loss: float = 0.0, documents: DocumentMask | None = None,
                         probes: str = "none"):
    """(params, tokens) -> (mean loss, gradients), or with `forward_only` the mean loss
    (the cross-entropy alone: `z_loss` weighs the training loss's z-loss term).
    `documents`: attention within each row's documents (data.document_mask).
    `probes`: "step", a third output where statistics ride a probe (`_probes`: a
    mixture of experts' routers, FP8's matmuls), the step's in the stage layout
    [stages, v, Lc, ...]; "filling", the same in the step that fills empty delayed-FP8
    histories (its matmuls scale currently, framework/model/fp8_delayed.py); "none"."""
    prog = layout.program
    probe = probes != "none" and not forward_only and bool(probe_kinds.kinds(layout))
    current = probes == "filling"
    # Parameters not sharded over `tensor` (norm scales). Without sequence parallelism
    # every tensor device computes their full gradient from identical activations; with
    # it each device sees its slice of the sequence, so they are summed over `tensor`.
    tensor_replicated = jax.tree.map(lambda s: TENSOR not in s, param_specs,
                                     is_leaf=lambda s: isinstance(s, P))
    # Expert parallelism: the leaves sharded over `expert`, summed over `data` only.
    expert_leaves = jax.tree.map(is_expert_leaf, param_specs,
                                 is_leaf=lambda s: isinstance(s, P)) \
        if layout.expert > 1 else None

    def evaluate(fns, params, inputs, targets, docs):
        # Forward only: a forward table over the same stages (nothing to interleave).
        loss = autodiff.forward(forward_program(prog), fns, params, inputs, targets, docs)
        return jax.lax.psum(loss, layout.manual)

    def train(fns, params, inputs, targets, docs):
        executor = autodiff if prog.autodiff else ticks
        if probe:
            params = probe_kinds.with_probes(params, layout, current)
        loss, grads = executor.loss_and_grads(prog, fns, params, inputs, targets, docs)
        if probe:
            grads, found = probe_kinds.take_probes(grads, layout)
        grads = reduce_gradients(grads, tensor_replicated, layout.sequence_parallel,
                                 zero1_dims, layout.gathers_per_use, layout.parallel.context,
                                 expert_leaves)
        loss = jax.lax.psum(loss, layout.manual)
        return (loss, grads, probe_kinds.reduce(found, layout)) if probe else (loss, grads)

    platform = mesh.devices.flat[0].platform
    cpu = platform == "cpu"
    if forward_only:
        body = device_fn(layout, zero1_dims, evaluate, False, StepOptions(0.0, documents, cpu))
        return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, P(layout.batch_axes)),
                             out_specs=P())
    options = StepOptions(z_loss, documents, cpu, passes_through(platform))
    body = device_fn(layout, zero1_dims, train, prog.schedule.split_backward, options)
    return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, P(layout.batch_axes)),
                         out_specs=(P(), param_specs) + ((P(PIPE),) if probe else ()))


def train_step(loss_and_grads, optimizer: optax.GradientTransformation, lr: optax.Schedule,
               weight_metrics=None, stats_metrics=None, stats_update=None):
    """The pure step: (state, tokens [global_batch, seq + 1]) -> (state, metrics).
    `weight_metrics`: params -> more metrics of the weights this step used (FP8's).
    `stats_metrics`: loss_and_grads's third output -> more metrics (MoE's router's).
    `stats_update`: (updated params, that output) -> params (MoE's balancing bias)."""

    def step(state, tokens):
        loss, grads, *stats = loss_and_grads(state["params"], tokens)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        if stats_update is not None:
            params = stats_update(params, *stats)
        widened = jax.tree.map(lambda g: g.astype(jnp.float32), grads)  # bfloat16 params
        metrics = {"train/loss": loss, "train/grad_norm": optax.tree.norm(widened),
                   "train/lr": lr(state["step"])}
        if weight_metrics is not None:
            metrics.update(weight_metrics(state["params"]))
        if stats_metrics is not None:
            metrics.update(stats_metrics(*stats))
        return train_state(params, opt_state, state["step"] + 1), metrics

    return step


def fp8_metrics(layout: Layout):
    """The `fp8/` metrics of the layers' FP8 weights (framework/model/fp8_stats.py), and with
    `model.fp8=delayed` of the scales the histories give, or None without FP8."""
    model = layout.model
    if model.fp8 == "none":
        return None
    weights = lambda params: fp8_stats.weight_stats(params["stages"], jnp.dtype(model.dtype))
    if model.fp8 == "delayed":
        return lambda params: {**weights(params), **fp8_delayed.scale_metrics(params["stages"])}
    return weights


def stats_update(layout: Layout):
    """What the step's probe statistics move in the parameters after each step (the MoE
    balancing bias, FP8's delayed-scaling histories: framework/engine/probes.py), or
    None."""
    return probe_kinds.stats_update(layout)


def probe_metrics(layout: Layout):
    """The metrics of the step's probe statistics (`moe/` of the routers, `fp8/` of the
    activations and gradients), or None where nothing rides a probe."""
    return partial(probe_kinds.metrics, layout=layout) if probe_kinds.kinds(layout) else None
