"""What the math requires each mesh axis to carry per step: the analytic side of the
communication audit (`framework/analysis/audit.py` measures the compiled program).

Bytes are sent per device per step, averaged over the devices, with ring collectives
on n devices (all-reduce 2(n-1)/n of the buffer; all-gather and reduce-scatter (n-1)/n
of the full buffer each). With B the global batch, s the sequence, d the model width,
L the layers, p/dp/tp the degrees, m the microbatches and A = (B/dp) * s * d the
hidden states of one data replica's batch (in the compute dtype):

  tensor  Megatron-LM: two reductions of the hidden states per layer in the forward and
          two in the backward (attention and MLP, f and g), for the L/p layers of a
          stage (uneven stages: the busiest rank's):  4 * (L/p) * 2(tp-1)/tp * A; 5 under
          full remat (the attention's forward reduction again). With sequence
          parallelism each all-reduce is an all-gather + reduce-scatter pair: the same
          bytes, and a rematerialised layer gathers its inputs again (`_layer_units`;
          a split backward's W runs the backward's again).
          Plus the vocabulary-parallel embedding (one reduction forward) and LM head
          (one backward), each on one pipeline rank, the loss's three [B/dp, s]
          float32 reductions (max, sum, label logit), and with sequence parallelism one
          all-reduce of the norm-scale gradients per step. Collective matmuls: the
          same bytes as rings; FP8's gathering rings one byte an element.
  pipe    Each microbatch's hidden states cross every stage boundary forward and its
          gradient crosses back: 2 * (p*v - 1)/p * A (1/tp of it with sequence
          parallelism; v chunks per rank for circular and interleaved_1f1b; 2p - 2
          boundaries between ranks for zb_v, whose turn stays on the last rank). With
          overlapped sends (`parallel.overlap_sends`) every pair of a channel sends in
          every tick of its phases, zeros where it has no message: the table's count
          (`Program.sends_per_step`) of A/m each, over p. Plus one all-reduce
          of the gradients of the parameters several ranks use (embedding, LM head,
          final norm), in the stored parameters' dtype (optim.param_dtype; float32).
  data    One all-reduce of this device's gradient shard per step (stored dtype, uneven
          stages' padding layers included); ZeRO-1's reduce-scatter + all-gather moves
          the same bytes. FSDP gathering per use: per microbatch, (dp-1)/dp of each
          layer's weights three times (gathered forward and backward, gradient
          reduce-scattered), and of the embedding and head on their ranks
          (`fsdp_bytes`).
  context Ring attention (framework/parallel/context.py), per layer: the forward passes
          the keys and values on c-1 times; the backward passes them c-1 times and
          their float32 gradients c times (`context_bytes`); a rematerialised layer's
          backward runs the forward ring again (c-1 more): the GPU compiler keeps those
          shifts, each beside its blocks, while the CPU's all-gathers of the same keys
          are merged with the backward's (measured on both). Plus one
          all-reduce of the gradients over `context`, stored dtype (joined with `data`'s;
          ZeRO-1 and FSDP: of the data shard, after its reduce-scatter).
          On CPU devices each shift is an all-gather (c-1 times the bytes).
  expert  Expert parallelism (framework/parallel/expert.py), per MoE layer and
          microbatch: the dispatch's all-to-alls of worst-case buffers, [E, N, d] with N
          = the device's tokens x top_k, (E-1)/E of each sent: the copies and their
          expert ids forward, the outputs back, and their two transposes backward
          (`expert_bytes`; a recomputing layer's backward runs the forward's three
          again; the zero-bubble split backward with remat: B and W each run the
          forward's three and both transposes). Plus the dense parameters' gradients, summed over `data` and `expert`:
          2(E-1)/E of them (`data` then counts the data/E replicas of the mesh's axis).
          The ragged exchange (`parallel.expert_exchange`, resolved: TPU and GPU's)
          sends the copies themselves, a data-dependent number: counted as the
          balanced expectation, (E-1)/E of the N copies each way, no ids (the audit
          counts a compiled ragged-all-to-all the same way); the counts it gathers
          first ([E, E_total] int32, and the transposes' offsets) are left out.
          Emulated (CPU): the dense buffers without the ids. With a
          capacity factor the buffers are the slots [E_total, rows x C, d] and no ids
          travel (`model.moe.capacity_factor`: c x the copies' bytes); with delayed FP8
          the forward's dispatch of them (and its recomputation) one byte an element
          (`model.fp8_dispatch`, framework/model/moe_slots.py).
With context parallelism A is one device's tokens: s/c of each sequence.
"""

from __future__ import annotations

import functools
import math

import jax

from framework.config import ModelConfig, ParallelConfig, TrainConfig, cast_at_use
from framework.engine.resolved import REMATS, Layout, Remat, resolved
from framework.model import fp8, fp8_delayed
from framework.model.prefix import DENSE, prefix_layers, stack_layers, unit_layers
from framework.model.registry import spec_of
from framework.model.moe_slots import capacity
from framework.parallel.mesh import CONTEXT, DATA, EXPERT, PIPE, TENSOR
from framework.parallel.pipeline.table import AUTODIFF
from framework.units import FP32, dtype_bytes


def _layout(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> Layout:
    return resolved(model, parallel, train.seq_len, train.global_batch_size)


def _ring_all_reduce(n: int) -> float:
    return 2 * (n - 1) / n


@functools.lru_cache(maxsize=64)
def _param_shapes(model: ModelConfig) -> tuple:
    """The model's parameter shapes (traced once per model, nothing allocated) and
    logical axes."""
    spec = spec_of(model)
    return (jax.eval_shape(lambda: spec.init_params(model, jax.random.key(0))),
            spec.logical_axes(model))


def local_param_counts(model: ModelConfig, parallel: ParallelConfig,
                       rank_layers: int | None = None) -> dict[str, int]:
    """Parameters held by one device, by top-level group (embed, layers, head), before
    any ZeRO-1 sharding: layers split over `pipe` (or `rank_layers` per rank, uneven
    stages' padding included), the rules' dims split over `tensor`."""
    shapes, axes = _param_shapes(model)
    counts = {}
    for group in shapes:
        total = 0
        for size in _local_sizes(shapes[group], axes[group], parallel):
            if group == "layers":
                size = (size // stack_layers(model) * rank_layers if rank_layers
                        else size // parallel.pipeline)
            total += size
        counts[group] = total
    # a MoE model's dense prefix (embed/dense, framework/model/prefix.py) apart
    counts["prefix"] = local_prefix_count(model, parallel)
    counts["embed"] -= counts["prefix"]
    return counts


def local_prefix_count(model: ModelConfig, parallel: ParallelConfig) -> int:
    """The dense prefix's parameters one device holds (every pipeline rank holds them)."""
    if not prefix_layers(model):
        return 0
    shapes, axes = _param_shapes(model)
    return sum(_local_sizes(shapes["embed"][DENSE], axes["embed"][DENSE], parallel))


def _local_sizes(shapes, axes, parallel: ParallelConfig):
    """Each leaf's elements on one device after the tensor split (the rules' dims)."""
    tensor_dims = set(parallel.tensor_split)
    for shape, names in zip(jax.tree.leaves(shapes),
                            jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, tuple))):
        yield math.prod(shape.shape) // parallel.tensor ** sum(n in tensor_dims for n in names)


def _layer_leaves_count(model: ModelConfig, parallel: ParallelConfig, rank_layers: int,
                        keep) -> int:
    """The layers' parameters one device holds (`local_param_counts`'s layers) in the
    leaves keep(name, logical axes) picks."""
    tensor_dims = set(parallel.tensor_split)
    shapes, axes = _param_shapes(model)
    total = 0
    for (path, shape), names in zip(jax.tree_util.tree_leaves_with_path(shapes["layers"]),
                                    jax.tree.leaves(axes["layers"],
                                                    is_leaf=lambda a: isinstance(a, tuple))):
        if keep(str(getattr(path[-1], "key", "")), names):
            size = math.prod(shape.shape) // parallel.tensor ** sum(n in tensor_dims for n in names)
            total += size // stack_layers(model) * rank_layers
    return total


def expert_param_count(model: ModelConfig, parallel: ParallelConfig, rank_layers: int) -> int:
    """The parameters of the MoE layers' experts one device holds (`local_param_counts`'s
    layers, the experts split over `expert`)."""
    return _layer_leaves_count(model, parallel, rank_layers,
                               lambda name, axes: "experts" in axes) // parallel.expert


def fp8_matrix_count(model: ModelConfig, parallel: ParallelConfig, rank_layers: int) -> int:
    """The layers' FP8 matrices' parameters one device holds (`fp8.MATRICES`)."""
    return _layer_leaves_count(model, parallel, rank_layers,
                               lambda name, axes: name in fp8.MATRICES)


def cast_matrix_count(model: ModelConfig, parallel: ParallelConfig, rank_layers: int) -> int:
    """The layers' parameters one device holds that every use casts to the compute dtype
    (`config.cast_at_use`: two or more dimensions a layer), the experts not split over
    `expert` (as `local_param_counts`)."""
    return _layer_leaves_count(model, parallel, rank_layers,
                               lambda name, axes: cast_at_use(len(axes) - 1))


def _gathered_fewer(model: ModelConfig, parallel: ParallelConfig, lay, counts: dict,
                    grad: int) -> float:
    """Bytes fewer than the stored dtype's that ZeRO-1's gather (FSDP's once a step)
    sends of what one device holds: the layers' and the head's matrices in the compute
    dtype (framework/parallel/data.py `gather_params`), with FP8 gathers the FP8
    matrices in one byte (framework/engine/fp8_gathers.py)."""
    rank_layers, e = lay.chunk_layers * lay.chunks_per_rank, parallel.expert
    matrices = cast_matrix_count(model, parallel, rank_layers) + counts["head"] - \
        model.d_model  # the head's: its matrix, not its norm's scale
    if e > 1:  # the experts split over `expert`
        matrices -= expert_param_count(model, parallel, rank_layers) * (e - 1)
    fp8_matrices = fp8_matrix_count(model, parallel, rank_layers) if fp8.gathers(model) else 0
    narrow = min(dtype_bytes(model.dtype), grad)
    return (matrices - fp8_matrices) * (grad - narrow) + fp8_matrices * (grad - 1)


def expert_bytes(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> float:
    """Bytes per device per step of the expert dispatch's all-to-alls (`expert`, above)
    on the busiest rank."""
    e, lay = parallel.expert, _layout(model, parallel, train)
    width = model.d_model * dtype_bytes(model.dtype)
    n = lay.rows_per_microbatch * lay.seq_per_device * model.moe.top_k  # copies N
    if model.moe.capacity_factor is None and parallel.expert_exchange == "ragged":
        rows, ids = (e - 1) * n * width / e, 0  # the balanced expectation: (E-1)/E of N
        there = rows  # the dispatch's bytes
    elif model.moe.capacity_factor is None:  # worst-case buffers (and the dense's ids)
        rows = (e - 1) * n * width  # (E-1)/E of [E, N, d]
        ids = (e - 1) * n * 4 if parallel.expert_exchange != "emulated" else 0
        there = rows
    else:  # the slots (framework/model/moe.py), no ids: (E-1)/E of [E_total, rows C, d]
        slots = model.moe.experts * lay.rows_per_microbatch * capacity(model, train.seq_len)
        rows, ids = (e - 1) * slots * width / e, 0
        # with delayed FP8 the slots go out as E4M3, one byte an element (moe_slots.py)
        there = rows / dtype_bytes(model.dtype) if fp8_delayed.sends_e4m3(model) else rows
    forward = there + rows + ids  # copies (and ids) out, outputs back
    per_layer = forward + 2 * rows + (forward if lay.recomputes else 0)
    if lay.split_recomputes:
        # B and W each recompute the forward from the layer's input and each runs both
        # transposes (W needs the combine's only; the other is not pruned)
        per_layer = 3 * forward + 4 * rows
    return per_layer * _busiest_layers(lay) * parallel.microbatches


def stage_sends(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> float:
    """Bytes per device per step of the pipeline's stage-to-stage sends (`pipe`, above)."""
    p, lay = parallel.pipeline, _layout(model, parallel, train)
    boundary = (lay.rows_per_replica * lay.seq_per_device * model.d_model
                * dtype_bytes(model.dtype)
                / (parallel.tensor if lay.sequence_parallel else 1))
    prog = lay.program
    if prog.schedule.overlap:
        return prog.sends_per_step / p * boundary / parallel.microbatches
    return 2 * prog.stages.crossings() / p * boundary


def layer_tensor_bytes(model: ModelConfig, parallel: ParallelConfig,
                       train: TrainConfig) -> float:
    """Bytes per device per step of the layers' tensor-parallel collectives (f and g,
    forward and backward) on the busiest rank: what a collective matmul sends beside
    the layers' matmuls (`parallel.collective_matmul`)."""
    lay = _layout(model, parallel, train)
    hidden = (lay.rows_per_replica * lay.seq_per_device
              * model.d_model * dtype_bytes(model.dtype))  # A
    # the layers' (`_layer_units`); a dense prefix (prefix.py) on the first stage only
    # (one rank in p: averaged), as a layer under autodiff, and under the tick executor
    # two more: its backward cell runs its forward again first
    layer = _layer_units(model, parallel, REMATS[lay.layer_remat], lay.split_recomputes)
    prefix = layer + (0 if lay.program.schedule.executor == AUTODIFF else 2)
    units = layer * _busiest_decoder_layers(lay) + prefix * prefix_layers(model) / parallel.pipeline
    return units * _ring_all_reduce(parallel.tensor) * hidden


def _layer_units(model: ModelConfig, parallel: ParallelConfig, remat: Remat, split=False) -> float:
    """One decoder layer's tensor collectives under `remat`, in all-reduces of A: 4 (f and
    g of the attention and the MLP, forward and backward). Without sequence parallelism
    f is the identity in the forward, and full remat's recompute sums the attention's g
    again: 5. With it each all-reduce's worth is a gather (f, a gathering ring with
    collective matmuls) and a reduce-scatter (g, a ring of partial sums), half each; a
    rematerialised layer's recompute gathers the attention's and the MLP's inputs again
    (their weight gradients read them; save_dots_gathered keeps them: none's 4,
    `Remat.regathers`) and, under full remat alone, sums the attention's g again (the
    MLP's norm reads it; save_dots keeps it, `tensor.EXITED`): 5.5 full, 5 save_dots
    (llama3_8b at 4 layers on the GPU compiler, 2026-12-02, MiB a step, 3,456 = 4 units
    + the head's 384: 4,608 full, 4,224 save_dots, 3,456 none; without SP 4,224 full,
    3,456 else). FP8's gathering rings carry one byte an element (FP8, 1F1B: 3,456,
    3,072, 2,688). `split` (`Layout.split_recomputes`): W runs the backward's f and g
    transposes again, under full remat the recomputed forward's too: 7 units save_dots,
    9 full (docs/performance.md, "Zero-bubble's rings")."""
    gathered, summed = int(remat.regathers), int(remat.recompute_forward)
    again = int(split and remat.keeps_inputs_only)  # W's backward (and recompute) again
    if not (parallel.sequence_parallel and parallel.tensor > 1):
        return 4 + summed + again * (2 + summed)
    gathers = 4 + 2 * gathered + again * (2 + 2 * summed)  # each half an all-reduce
    scatters = 4 + summed + again * (2 + summed)
    per = 1 / dtype_bytes(model.dtype) \
        if model.fp8 != "none" and parallel.collective_matmul else 1.0
    return (gathers * per + scatters) / 2


def recomputed_ring_share(model: ModelConfig, parallel: ParallelConfig, split=False) -> float:
    """Of a decoder layer's collective-matmul bytes under save_dots, the share its
    recompute sends again (the two gathering rings: `_layer_units`); `split`: of a split
    backward's, whose W's backward rings again run beside their matmuls."""
    units = lambda name, split=False: _layer_units(model, parallel, REMATS[name], split)
    return (units("save_dots") - units("none")) / units("save_dots", split)


def context_bytes(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                  permute: bool = True) -> float:
    """Bytes per device per step of the ring attention's shifts (`context`, above) on
    the busiest rank; `permute=False`: the CPU's all-gather shifts."""
    c, lay = parallel.context, _layout(model, parallel, train)
    kv_heads = model.n_kv_heads // (parallel.tensor if "kv_heads" in parallel.tensor_split
                                    else 1)
    kv = (lay.rows_per_replica * lay.seq_per_device * 2 * kv_heads
          * model.head_dim * dtype_bytes(model.dtype))  # k and v, one layer
    # the gradients' c shifts in float32; the GPU compiler casts before the last one
    sums = (c - permute) * FP32 / dtype_bytes(model.dtype) + permute
    # a layer's, with the recomputed forward's ring (above) `again`
    shifts = lambda again: ((2 + again) * (c - 1) + sums) * kv * (1 if permute else c - 1)
    # a dense prefix (prefix.py) on the first stage only: as a layer under autodiff;
    # under the tick executor its backward cell runs its forward again first (on CPU
    # too, where nothing merges that with the backward's); averaged over the p ranks,
    # as the audit counts a conditional's collectives (and `layer_tensor_bytes` its
    # tensor collectives)
    layer = shifts(permute and lay.recomputes)
    prefix = layer if lay.program.schedule.executor == AUTODIFF else shifts(True)
    return layer * _busiest_decoder_layers(lay) + prefix * prefix_layers(model) / parallel.pipeline


def _busiest_layers(lay: Layout) -> int:
    """The stacked units of the busiest pipeline rank (uneven stages:
    `parallel.stage_layers`): its MoE layers."""
    counts = lay.stage_layer_counts
    return max(sum(counts[g] for g in row) for row in lay.program.stages.of)


def _busiest_decoder_layers(lay: Layout) -> int:
    """The decoder layers of the busiest pipeline rank (model.moe.every per unit)."""
    return _busiest_layers(lay) * unit_layers(lay.model)


def fsdp_bytes(model: ModelConfig, parallel: ParallelConfig, counts: dict,
               stored: int = FP32, autodiff: bool = False) -> float:
    """`data` with FSDP gathering per use (framework/parallel/data.py), float32 shards:
    per microbatch each layer is gathered for its forward and again for its backward
    (in the compute dtype: the matrices travel cast, the norm scales' few bytes are
    counted so too) and its gradient reduce-scattered (float32); the embedding gathered
    for the first stage's forward (its lookup's backward needs no weights), the head
    (and a tied table) gathered forward and backward on the last stage: each on one of
    p ranks; the table always in float32. `stored`: bytes of a stored parameter
    (optim.param_dtype; bfloat16 ones travel as stored). With FP8 gathers the layers'
    matrices travel in one byte."""
    share = (parallel.data - 1) / parallel.data
    # two gathers (cast where the compute dtype is narrower), one reduce-scatter
    cast = 2 * min(dtype_bytes(model.dtype), stored) + stored
    ends = 2 * stored * counts["embed"] + cast * counts["head"]
    # a dense prefix, gathered layer by layer as the layers are (cast): per microbatch
    # for the forward, then in its backward's recomputed forward and again for the
    # backward itself (the tick executor), or (`autodiff`, which embeds every microbatch
    # at once) once a step for the forward and once for the backward; its gradient
    # reduce-scattered as stored each time
    one = min(dtype_bytes(model.dtype), stored)
    prefix = counts.get("prefix", 0)
    once = (2 * one + stored) * prefix / parallel.microbatches if autodiff else 0.0
    ends += 0.0 if autodiff else (3 * one + stored) * prefix
    if model.tie_embeddings:
        ends += 3 * stored * counts["embed"]
    # FP8 gathers (model.fp8_gather): the layers' two gathers one byte an element (the
    # norm scales' few bytes counted so too; the scales' all-reduced maxima are scalars)
    layer = 2 + stored if fp8.gathers(model) else cast
    return parallel.microbatches * share * (layer * counts["layers"]
                                            + (ends + once) / parallel.pipeline)


def expected_bytes(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                   permute: bool = True, param_dtype: str = "float32") -> dict[str, float]:
    """Bytes each mesh axis must carry per device per step (see the module docstring);
    `permute=False`: ring shifts as the CPU's all-gathers. Gradients travel in the
    stored parameters' dtype (`param_dtype`, optim.param_dtype)."""
    grad, lay = dtype_bytes(param_dtype), _layout(model, parallel, train)
    p, dp, tp, c = parallel.pipeline, parallel.data, parallel.tensor, parallel.context
    rows, tokens = lay.rows_per_replica, lay.seq_per_device
    hidden = rows * tokens * model.d_model * dtype_bytes(model.dtype)  # A
    layers = _busiest_layers(lay)
    counts = local_param_counts(model, parallel, lay.chunk_layers * lay.chunks_per_rank)

    tensor = layer_tensor_bytes(model, parallel, train)
    tensor += 2 * _ring_all_reduce(tp) * hidden / p  # embedding fwd, LM head bwd
    if prefix_layers(model) and lay.program.schedule.executor != AUTODIFF:
        # the embedding again, before the prefix's backward (prefix.py; without one XLA
        # drops the unused lookup): under SP a reduce-scatter, half an all-reduce
        tensor += _ring_all_reduce(tp) * hidden / p / (2 if lay.sequence_parallel else 1)
    tensor += 3 * _ring_all_reduce(tp) * rows * tokens * FP32 / p  # loss
    if lay.sequence_parallel:
        # the scales replicated over `tensor`: 2 per layer (4 with Gemma's post-norms) +
        # the final one, and q/k norm's two of head_dim (biases are split with their heads)
        held_layers = layers * unit_layers(model) + prefix_layers(model)  # and the prefix
        norms = ((2 + 2 * model.has_post_norms) * held_layers + 1) * model.d_model + \
            2 * held_layers * model.head_dim * model.has_qk_norm
        tensor += _ring_all_reduce(tp) * norms * grad

    pipe = stage_sends(model, parallel, train)
    shared = counts["embed"] + counts["prefix"] + counts["head"]  # on several pipeline ranks
    # FSDP per use: their gradients arrive sharded over `data` already
    pipe += _ring_all_reduce(p) * shared * grad / (dp if lay.gathers_per_use else 1)

    e, held = parallel.expert, sum(counts.values())  # held: the gradients a device holds
    if e > 1:  # the experts split over `expert`; the dense gradients summed over it too
        experts = expert_param_count(model, parallel, lay.chunk_layers * lay.chunks_per_rank)
        held -= experts * (e - 1)
        expert = expert_bytes(model, parallel, train) + _ring_all_reduce(e) * (
            held - experts) * grad
    data = _ring_all_reduce(dp // e) * held * grad
    if parallel.zero1 or parallel.fsdp:  # the once-a-step gather's narrower matrices
        data -= (dp // e - 1) / (dp // e) * _gathered_fewer(model, parallel, lay, counts, grad)
    if lay.gathers_per_use:
        data = fsdp_bytes(model, parallel, counts, grad,
                          lay.program.schedule.executor == AUTODIFF)
    context = context_bytes(model, parallel, train, permute)
    sharded = parallel.zero1 or parallel.fsdp  # summed over `context` on the data shard
    context += _ring_all_reduce(c) * held * grad / (dp if sharded else 1)
    out = {PIPE: pipe if p > 1 else 0.0, DATA: data if dp // e > 1 else 0.0,
           CONTEXT: context if c > 1 else 0.0, TENSOR: tensor if tp > 1 else 0.0}
    return {**out, EXPERT: expert} if e > 1 else out
