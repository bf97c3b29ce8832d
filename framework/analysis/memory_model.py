"""Per-device memory of the train step, predicted without devices or compilation: the
memory side of the parallelism planner (`framework/analysis/planner.py`), as
`framework/analysis/comm_model.py` is its communication side.

Memory per device (bytes): what XLA's buffer assignment holds at the step's peak.

  params, optimizer  the parameters (`optim.param_dtype`) and AdamW's two moments
             (mu `optim.mu_dtype`, nu float32; `framework/engine/optim.py`; Muon's
             matrices keep one moment, counted as AdamW's two), each leaf's local shard
             by the engine's layout and rules: layers over `pipe`, the rules' dims over
             `tensor` (`framework/parallel/rules.py`), ZeRO-1 one over `data`; the tokens.
  gradients  in the parameters' dtype, every parameter's local pre-ZeRO shape (with FSDP
             its stored shard: under the tick executor the accumulators alone); with
             ZeRO-1 also the all-gathered parameters (on TPUs the layers' in the compute
             dtype: its compiler casts them before the gather); autodiff's tick scan
             (GPipe, circular) and its accumulation also a sum of the stage's weights'. The
             tick executor instead: its accumulators (the reductions after the loop
             reuse them) and one cell's fresh gradients of its chunk; as transients, with one chunk a rank the cell's add (old and
             new accumulators side by side with the leaf being added), with several
             the chunk's weights sliced out (a copy; the add is in place), and with
             ZeRO-1 the shards transposed for the all-gather before the loop; with
             collective matmuls a layer's weight-gradient partials, with uneven stages
             a layer's weights and gradient leaf apart (`_layer_extras`).
  activations  what the backward keeps from the forward. One layer's VJP residuals are
             measured exactly by tracing `jax.vjp` of the engine's `apply_layers` under
             `jax.eval_shape`, in a shard_map over an abstract `tensor` mesh (no
             devices, nothing compiled; the model's own tensor-parallel plan and
             collectives), split into a part per token row and a part per layer (e.g.
             bfloat16 casts of the weights). Remat policies change what the VJP keeps,
             so the trace follows them; so does the attention kernel (`auto` resolved for
             the platform predicted for; cudnn, which cannot be traced off a GPU, as
             blockwise: both keep q, k, v, blockwise also its output and a float32
             log-sum-exp, a slight overestimate). Per schedule
             (`framework/parallel/pipeline/`):
               GPipe / circular: autodiff of the tick loop keeps every forward tick's
                 residuals, (v*m + p - 1) ticks x one chunk for one microbatch; the
                 per-layer part once (loop-invariant), except in the circular schedule,
                 where the chunk's weights are sliced per tick; plus the whole local
                 batch's hidden states (inputs, outputs and their gradients);
               tick executor (1F1B, interleaved 1F1B, ZB-H1, ZB-V): measured, not
                 recounted: the executor's own state before its first tick
                 (`executor_state`: `jax.eval_shape` of its `initial_carry`: the
                 receive slots, the stash slots of the program's buffer plan, the
                 gradient accumulators, the pending sends), plus what a cell's
                 branch returns for a write after it (`executor_state`'s `slot`: F's
                 residuals as one fresh stash slot only where they are not written in
                 place layer by layer, i.e. on the GPU compiler before jaxlib 0.11.2
                 or beside a split backward's weight-op inputs; B's entry of the saved
                 buffers) and, with overlapped sends, the message arriving beside the
                 cell; and the layers' weights the executor makes once a step
                 (`framework/engine/step_weights.py`), all but one chunk's: the cell
                 held its chunk's casts before (`_tick_kept`).
  transient  the largest of the moments that do not overlap: the LM head + loss (a few
             float32 logits-sized tensors of one microbatch: both executors run the head
             microbatch by microbatch; with `model.loss_chunk` those of one chunk, beside
             the head's float32 weight-gradient sum: `transients.head_bytes`) and one
             layer's backward (its full residuals once more, the attention kernel's score tensors, and the tick's slice of the
             residual stack), and with FSDP a third after the layers' loop: the
             embedding's whole gradient scatter-added before its reduce-scatter.
The constants that are not traced (copies of logits and batch-sized tensors) were read
from XLA's buffer assignment, per compiler where the compilers differ: each is a row of
`framework/analysis/fitted.py` with the program, target, jaxlib and date it was read
from; `tests/compiled/test_memory.py` checks the total against the compiled memory
analysis. On CPU, XLA computes bfloat16 in float32, so bfloat16 models (and bfloat16
parameters) need more there than predicted (the prediction is for accelerators, which
keep bf16: llama_1b_8gpu, bfloat16 parameters, GPU compiler: 1.07x; test_aot.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import jax

from framework.analysis.executor_state import executor_state
from framework.analysis.fitted import fitted
from framework.analysis.comm_model import local_prefix_count
from framework.analysis.residuals import Residuals, attention_traced, residuals
from framework.analysis.transients import attention_scores_bytes, head_bytes
from framework.config import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from framework.engine.resolved import Layout, resolved, with_exchange
from framework.engine.state import abstract_train_params, param_specs
from framework.engine.step import tensor_parallel
from framework.model import fp8
from framework.model.prefix import dense_config, prefix_layers, stack_layers, unit_layers
from framework.parallel.expert import ExpertParallel
from framework.parallel.pipeline.autodiff import accumulates
from framework.parallel.pipeline.table import AUTODIFF
from framework.units import FP32, dtype_bytes


@dataclass(frozen=True)
class Weights:
    """Local float32 bytes of the parameters on one device, from the engine's own layout
    and rules (`framework/engine/state.py`): all of them, the same after ZeRO-1's or
    FSDP's sharding over `data`, the stage's layers alone, and its largest layer leaf;
    `fp8`: the stage's FP8 matrices (`fp8.MATRICES`) alone."""

    full: int
    stored: int
    stage: int
    leaf: int
    fp8: int


@lru_cache(maxsize=None)
def param_bytes(lay: Layout) -> Weights:
    shapes = abstract_train_params(lay.model, lay.parallel.pipeline, lay.chunks_per_rank,
                                   lay.stage_layers)
    degrees = {**lay.degrees, None: 1}
    # a dimension split over several axes (ZeRO-1/FSDP over data and expert)
    ways = lambda a: math.prod(degrees[x] for x in a) if isinstance(a, tuple) else degrees[a]
    is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)

    def sizes(tree_specs, group=None, keep=lambda path: True):
        for k in shapes if group is None else (group,):
            for (path, shape), spec in zip(jax.tree_util.tree_leaves_with_path(shapes[k]),
                                           jax.tree.leaves(tree_specs[k], is_leaf=is_spec)):
                if keep(path):
                    yield math.prod(shape.shape) // math.prod(map(ways, spec)) * FP32

    unsharded = dataclasses.replace(lay.parallel, zero1=False, fsdp=False)
    plain = param_specs(resolved(lay.model, unsharded))[0]
    stored = param_specs(lay)[0]
    return Weights(sum(sizes(plain)), sum(sizes(stored)), sum(sizes(plain, "stages")),
                   max(sizes(plain, "stages")), sum(sizes(plain, "stages", fp8.is_matrix)))


def _widths(optim: OptimConfig) -> tuple[float, float]:
    """Bytes per float32 byte: of a stored parameter or gradient, of AdamW's two moments."""
    return (dtype_bytes(optim.param_dtype) / FP32,
            (dtype_bytes(optim.mu_dtype) + FP32) / FP32)


def _autodiff_kept(res: Residuals, ticks: int, layers: int, mb_rows: int, v: int,
                   stage_weights: int, batch_hidden: float, cast: float | None) -> float:
    """What autodiff's tick scan keeps until its backward: every forward tick's
    residuals, the loop-invariant part once, and GPipe's batch-sized copies. `cast`:
    None, or (TPU) the compute dtype's bytes per float32 byte (batch_copies/tpu)."""
    per_tick = layers * mb_rows * res.per_row
    fixed = layers * res.per_layer  # loop-invariant over ticks: kept once
    copies = fitted("batch_copies/gpipe")
    weights = stage_weights // v  # the chunk's weights, float32 bytes
    if cast is not None:  # TPU: the weights' cast kept, not the float32 weights
        weights *= cast
        fixed += 0 if v > 1 else weights  # one chunk: the stage's cast, once
        copies = fitted("batch_copies/tpu") + (v > 1)
    if v > 1:  # the chunk's weights are sliced per tick (dynamic index): saved per tick
        per_tick += fixed + weights
    return ticks * per_tick + fixed + copies * batch_hidden


def _layer_residuals(lay: Layout, remat: str, model: ModelConfig | None = None) -> Residuals:
    """One layer's (a stacked unit's) residuals as the layout runs it (its tensor plan,
    sequence split and expert plan) under `remat`; `model`: another layer of it."""
    return residuals(model or lay.model, lay.seq_per_device, tensor_parallel(lay), remat)


def _prefix(lay: Layout, remat: str) -> float:
    """A MoE model's dense prefix (framework/model/prefix.py) for one microbatch: its
    layers' residuals under `remat` (0 without one)."""
    k = prefix_layers(lay.model)
    if k == 0:
        return 0.0
    dense = dataclasses.replace(tensor_parallel(lay), expert=ExpertParallel())  # no experts
    res = residuals(dense_config(lay.model), lay.seq_per_device, dense, remat)
    return res.chunk(k, lay.rows_per_microbatch)


def _prefix_backward(lay: Layout, tpu: bool) -> float:
    """The first stage's backward of a MoE model's dense prefix (prefix.py), recomputed
    from the ids: its residuals for one microbatch under the layers' remat, then one
    dense layer's backward in flight (as `_layer_backward`, the dense layer's), with
    FSDP that layer's weights gathered in the compute dtype (layer by layer as the
    stack's, gathered again for the backward, never kept) and its float32 gradient
    before the reduce-scatter; 0 without a prefix."""
    k = prefix_layers(lay.model)
    if k == 0:
        return 0.0
    dense = dense_config(lay.model)
    held = _layer_residuals(lay, "none", dense).chunk(1, lay.rows_per_microbatch)
    held += attention_scores_bytes(
        dense, lay.rows_per_microbatch, lay.seq_per_device, lay.parallel.tensor)
    if lay.gathers_per_use:
        one = local_prefix_count(lay.model, lay.parallel) / k
        held += one * (min(dtype_bytes(lay.model.dtype), FP32) + FP32)
    return _prefix(lay, lay.layer_remat) + (held * fitted("layer_backward/tpu") if tpu
                                             else held)


def _layer_forward(lay: Layout) -> float:
    """One layer's forward in flight: its activations, as its backward would keep them
    without remat (a combined cell's F beside its BW's layer: a layer's backward holds
    them too)."""
    return _layer_residuals(lay, "none").chunk(1, lay.rows_per_microbatch)


def _layer_backward(lay: Layout, tpu: bool) -> float:
    """One layer's backward in flight: its residuals once more (recomputed under
    remat) and the attention kernel's score blocks; the TPU's fused backward holds
    layer_backward/tpu of that."""
    held = _layer_forward(lay)
    if unit_layers(lay.model) > 1 and lay.layer_remat == "none":
        # a unit of model.moe.every layers (prefix.py) whose residuals are kept: its
        # layers' backwards one at a time (under remat its forward is recomputed whole;
        # save_dots keeps part of it: counted whole, an over-estimate)
        one = lambda m: _layer_residuals(lay, "none", m).chunk(1, lay.rows_per_microbatch)
        held = max(one(dataclasses.replace(lay.model, moe=dataclasses.replace(
            lay.model.moe, every=1), n_layers=prefix_layers(lay.model) + stack_layers(lay.model))),
            one(dense_config(lay.model)))
    held += attention_scores_bytes(
        lay.model, lay.rows_per_microbatch, lay.seq_per_device, lay.parallel.tensor)
    return held * fitted("layer_backward/tpu") if tpu else held


def _zero1_gathered(full: int, stored: int, stage_weights: int, cast: float | None,
                    v: int, bits: int = 0) -> float:
    """ZeRO-1's gathered parameters (0 without ZeRO-1), float32 bytes. They travel in
    the compute dtype (framework/parallel/data.py `gather_params`; before 2026-11-30 the
    TPU compiler alone cast them before the all-gather: llama3_70b_v5p at pp8-dp4-tp2,
    interleaved, 2026-11-26); where they are held so (`cast` not None: on TPUs, and
    under the tick executor, whose once-a-step weights are those gathered values:
    llama3_8b at 4 layers, pp1-dp2, 1F1B, gpu:h100x8: 7.94 -> 6.90 GiB compiled with
    the copy, predicted 1.25x the compiler until counted so). With one chunk a rank
    they take the place of the stage's cast that the TPU program holds anyway
    (`_autodiff_kept`'s `fixed`, the tick executor's per-layer residuals and its
    once-a-step weights, `_tick_kept`): ZeRO-1 adds only the embedding and head
    gathered (compiled, ZeRO-1 on against off, 1F1B: llama3_70b_v5p +0.98 GiB, its
    embedding's float32 shard; llama_1b_8gpu on tpu:v5p-16 +0.50, likewise; 2026-11-27).
    `bits`: the stage's FP8 matrices that FP8 gathers bring (framework/engine/
    fp8_gathers.py), held as their E4M3 bits, one byte an element, by every executor
    (the uses read the bits; the values beside them only take the gradient: gpu:h100x64,
    llama3_70b with FP8, 34.88 -> 33.32 GiB compiled; llama3_8b at 4 layers, pp1-dp2-tp4,
    GPipe 13.30 -> 12.61; 2026-12-02)."""
    if stored == full:
        return 0
    if cast is not None and v == 1:
        return full - stage_weights
    width = 1 if cast is None else cast  # the rest of the stage's, of float32's bytes
    held = (stage_weights - bits) * width + bits * dtype_bytes(fp8.E4M3) / FP32
    return full - stage_weights + held


def _tick_kept(state: dict, v: int, gathered: float, per_use: bool = False) -> float:
    """The tick executor's state (`executor_state`: with a split backward and a pair
    of ticks a step, B's douts held for the next tick too) + with overlapped sends the
    message arriving beside the cell, one per pending one + the weights made once a
    step but one chunk's (`v` chunks a rank): the cell held its chunk's casts before
    (the GPU compiler's peak, gpu:h100x8, 2026-11-30, copy on against off: llama3_8b
    +0.25 GiB of its 1.87 GiB copy, one chunk; llama_1b_8gpu zb_v remat=none, two
    chunks, +0.34 of 0.45; qwen3_30b_a3b at pp4-tp2, six chunks, +3.06 of 6.97). With
    ZeRO-1 (`gathered`) the copy is the gathered values (`_zero1_gathered` counts them).
    With FSDP per use (`per_use`) the copy is the FP8 matrices FSDP leaves whole, all of
    it held: the uses had quantized them a layer at a time (qwen3_30b_a3b at 8 layers,
    FP8 delayed, gpu:h100x8, 2026-12-01: 1.13 GiB). The chunk's casts are counted in
    the compute dtype (`weight_casts`) where the copy holds FP8 matrices as one-byte
    bits: llama3_8b with FP8, one chunk, 23.97 -> 23.17 GiB compiled when the copy went
    from the E4M3 values in bfloat16 to their bits (gpu:h100x8, 2026-12-01)."""
    weights = state["weights"] if per_use else \
        0 if gathered else state["weights"] - state["weight_casts"] / v
    return state["recv"] + state["stash"] + state["saved"] + 2 * state["pending"] + \
        state["held"] + weights


def _layer_extras(lay: Layout, backward: float, w: Weights, width: float) -> float:
    """One layer's backward in a tick cell with what some layouts add (float32 bytes of
    one layer's weights and largest leaf; read from llama3_405b's buffer assignment on
    gpu:h100x1024): collective matmuls' weight gradients, one partial per ring step in
    the compute dtype, summed only at the layer's end when its residuals are mostly
    spent (the split backward keeps plain collectives, framework/parallel/tensor.py);
    uneven stages run each layer under a cond (`stage.skip_unless`): its weights sliced
    out of the chunk (a copy) and its largest gradient leaf returned apart."""
    layers = lay.chunks_per_rank * lay.chunk_layers  # a rank's, padded
    layer_weights, layer_leaf = w.stage / layers, w.leaf / layers
    if lay.sequence_parallel and lay.parallel.collective_matmul \
            and not lay.program.schedule.split_backward:
        backward = max(backward, lay.parallel.tensor * layer_weights
                       * dtype_bytes(lay.model.dtype) / FP32)
    if lay.stage_layers is not None:
        backward += (layer_weights + layer_leaf) * width
    return backward


def _tick_gradients(lay: Layout, state: dict, grads: float, backward: float, w: Weights,
                    width: float, gathered: float) -> tuple[float, float]:
    """The tick executor's (gradients, layer-backward transient), read from the GPU
    compiler's buffer assignments of llama_1b_8gpu (1F1B, gpu:h100x8) and llama3_70b
    (5 chunks a rank, gpu:h100x64); float32 bytes (`width`: a stored parameter's share
    of float32's), `grads` what the caller counted so far, `gathered` ZeRO-1's gathered
    parameters (0 without)."""
    if lay.gathers_per_use:  # FSDP: the loop's accumulators, sharded, are the gradients
        # (no second copy: mixtral_8x7b's buffer assignment, gpu:h100x16, holds its
        # experts' and the dense leaves' gradients only there, 2026-11-30)
        return state["grads"], backward
    # the accumulators (which the reductions after the loop reuse) and the cell's fresh
    # gradients of its chunk, carried through the layer scan
    v = lay.chunks_per_rank
    chunk = w.stage / v
    grads = state["grads"] + chunk + gathered
    if v > 1:  # the cell slices its chunk's weights (a dynamic index: a copy) and adds
        # into the stacked accumulators in place
        backward += chunk * width
    else:  # a[0] += g is out of place: old and new accumulators side by side, beside
        # the leaf being added
        backward = max(backward, (state["grads"] + w.leaf - chunk) * width)
    if gathered:  # ZeRO-1, before the loop: the accumulators' zeros and the
        # gathered parameters beside the shards transposed for the gather
        backward = max(backward, (w.stored - chunk) * width)
    return grads, backward


def _fsdp_embedding_gradient(lay: Layout) -> float:
    """FSDP, after the layers' loop: the embedding's gradient scatter-added whole (a
    float32 vocab/tensor x d_model zero buffer and the scatter's result) before its
    reduce-scatter over `data` (llama3_8b at pp2-dp8 FSDP, interleaved 1F1B v8,
    gpu:h100x16: the step's peak, two 1.96 GiB buffers beside the sharded gradients,
    2026-11-30); 0 without FSDP, where the embedding's gradient is whole anyway."""
    if not lay.gathers_per_use:
        return 0
    return 2 * lay.model.vocab_size // lay.parallel.tensor * lay.model.d_model * FP32


def _executor_terms(lay: Layout, platform: str | None, w: Weights, width: float,
                    grads: float, layer_backward: float, cast: float | None,
                    gathered: float) -> tuple[float, float, float, float]:
    """(kept activations, the head's peak, the layers' backward peak, gradients) of the
    layout's executor: autodiff's tick scan, or the tick executor's measured state."""
    sched, v, layers = lay.program.schedule, lay.chunks_per_rank, lay.chunk_layers
    m, mb_rows = lay.parallel.microbatches, lay.rows_per_microbatch
    if sched.executor != AUTODIFF:  # its own state (receive slots, stash, accumulators)
        state = executor_state(lay.model, lay.parallel, lay.global_batch, lay.seq_len,
                               platform)
        backward = _layer_extras(lay, layer_backward + state["slot"], w, width)
        grads, backward = _tick_gradients(lay, state, grads, backward, w, width, gathered)
        head = head_bytes(lay, "1f1b", platform)
        return _tick_kept(state, v, gathered, lay.gathers_per_use), head, backward, grads
    # autodiff: every forward tick's residuals, until the backward; accumulating (no
    # pipeline, `autodiff.accumulated`) one microbatch's, its gradients added to a sum
    res, acc = _layer_residuals(lay, lay.layer_remat), accumulates(lay.program)
    ticks, held = (1, 1) if acc else (sched.forward_rows().n_ticks, m)
    hidden = mb_rows * lay.hidden_seq * lay.model.d_model * dtype_bytes(lay.model.dtype)
    kept = _autodiff_kept(res, ticks, layers, mb_rows, v, w.stage, hidden * held, cast)
    # the first stage embeds every microbatch at once (a dense prefix: its residuals)
    kept += held * _prefix(lay, lay.layer_remat)
    head = head_bytes(lay, "per_microbatch" if held > 1 else "whole_batch", platform)
    grads += acc * w.stage / (lay.parallel.data if lay.gathers_per_use else 1)
    backward = layer_backward
    if ticks > 1:  # the tick scan's backward: one tick's slice of the residual stack,
        backward += res.chunk(layers, mb_rows)  # and a gradient accumulator for the
        grads += w.stage / (lay.parallel.data if lay.gathers_per_use else 1) / (
            v if cast is not None else 1)  # stage's weights (TPU: the chunk's)
    return kept, head, backward, grads


def predict_memory(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                   platform: str | None = None, optim: OptimConfig | None = None) -> dict:
    """Predicted bytes per device at the step's peak, by term (see the module
    docstring); 'total' sums them. `platform` decides what `model.attention=auto` runs
    (default: JAX's default backend); `optim` the stored dtypes (default float32)."""
    stored_width, moments_width = _widths(optim or OptimConfig())
    parallel = with_exchange(parallel, platform or jax.default_backend())  # as built
    lay = resolved(attention_traced(model, train.seq_len, platform), parallel,
                   train.seq_len, train.global_batch_size)
    w = param_bytes(lay)
    tpu = (platform or jax.default_backend()) == "tpu"
    cast = dtype_bytes(lay.model.dtype) / FP32 if tpu else None
    layer_backward = _layer_backward(lay, tpu)
    # the tick executor makes its weights from ZeRO-1's gather (in the compute dtype,
    # framework/parallel/data.py): held as the TPU compiler holds them
    narrow = dtype_bytes(lay.model.dtype) / FP32
    once = lay.program.schedule.executor != AUTODIFF and not lay.gathers_per_use and \
        narrow < stored_width
    gathered = _zero1_gathered(w.full, w.stored, w.stage, narrow if once else cast,
                               lay.chunks_per_rank, w.fp8 if fp8.gathers(lay.model) else 0)
    grads = w.full + gathered
    if lay.gathers_per_use:  # FSDP: gradients sharded, nothing gathered for the step; one
        # layer's float32 weights gathered at a time, their cast and gradient beside them
        grads = w.stored
        layer_backward += 3 * w.stage / (lay.chunks_per_rank * lay.chunk_layers)
    if lay.program.combined:  # a combined cell: a layer's forward beside its backward, with
        # its activations (as kept without remat; Mixtral's recipe on the GPU compiler, FSDP:
        # +2.5 GiB compiled, +2.7 this term; its gathered weights fit in what it frees)
        layer_backward += _layer_forward(lay)
    kept, head, backward, grads = _executor_terms(lay, platform, w, stored_width, grads,
                                                  layer_backward, cast, gathered)
    out = {
        "params": w.stored * stored_width,
        "optimizer": moments_width * w.stored,  # AdamW's mu and nu, sharded like the params
        "tokens": lay.rows_per_replica * (train.seq_len + 1) * 4,
        "gradients": grads * stored_width,
        "activations": kept,
        # the head's peak, the layers' and (FSDP) the embedding's after the loop do not overlap
        "transient": max(head, backward, _fsdp_embedding_gradient(lay),
                         _prefix_backward(lay, tpu)),
    }
    out["total"] = sum(out.values())
    return out
