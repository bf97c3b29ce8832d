"""Per-device memory of the train step, predicted without devices or compilation: the
memory side of the parallelism planner (`framework/analysis/planner.py`), as
`framework/analysis/comm_model.py` is its communication side.

Memory per device (bytes): what XLA's buffer assignment holds at the step's peak.

  params, optimizer  the parameters (`optim.param_dtype`) and AdamW's two moments
             (mu `optim.mu_dtype`, nu float32; `framework/engine/optim.py`; Muon's
             matrices keep one moment, counted as AdamW's two),
             each leaf's local shard by the engine's own layout and rules: layers split
             over `pipe`, the rules' dims over `tensor` (`framework/parallel/rules.py`), with
             ZeRO-1 one dim over `data` (`framework/parallel/data.py`). Plus the tokens.
  gradients  in the parameters' dtype, every parameter's local pre-ZeRO shape; with ZeRO-1 also the
             all-gathered parameters (on TPUs the layers' in the compute dtype: its
             compiler casts them before the gather); autodiff's tick scan (GPipe, circular) also a
             gradient accumulator of the stage's weights. The tick executor instead:
             its accumulators (the
             reductions after the loop reuse them) and one cell's fresh gradients of
             its chunk; as transients, with one chunk a rank the cell's add (old and
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
                 gradient accumulators, the pending sends), plus one stash slot's entry
                 (what a backward cell's branch returns for the write after it: with
                 synchronous sends or a split backward's B) and, with overlapped
                 sends, the message arriving beside the cell.
  transient  the larger of two moments that do not overlap: the LM head + loss (a few
             float32 logits-sized tensors of one microbatch: both executors run the head
             microbatch by microbatch) and one layer's backward (its full residuals once
             more, the attention kernel's score tensors, and the tick's slice of the
             residual stack).
The constants that are not traced (copies of logits and batch-sized tensors) were read
from XLA's buffer assignment, per compiler where the compilers differ (the GPU's head,
the TPU's head, layer backward and autodiff scan: TPU_*);
`tests/compiled/test_memory.py` checks the total against the compiled memory analysis. On CPU, XLA computes bfloat16 in float32, so bfloat16 models
(and bfloat16 parameters) need more there than predicted (the prediction is for
accelerators, which keep bf16: llama_1b_8gpu with bfloat16 parameters on the GPU
compiler, 1.07x; tests/compiled/test_aot.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import AbstractMesh, PartitionSpec as P

from framework.analysis.executor_state import executor_state, nbytes
from framework.config import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from framework.engine.split import split_layers
from framework.engine.state import abstract_train_params, param_specs
from framework.engine.validate import resolve_stage_layers, stage_layer_counts
from framework.model import attention
from framework.model.llama import Block, apply_layers
from framework.parallel.data import gathers_per_use
from framework.parallel.mesh import DATA, PIPE, TENSOR
from framework.parallel.pipeline.program import program_of
from framework.parallel.pipeline.stage import split_vjp
from framework.parallel.pipeline.table import AUTODIFF
from framework.parallel.rules import param_rules
from framework.parallel.tensor import TensorParallel

FP32 = 4


@lru_cache(maxsize=None)
def _residual_bytes(model: ModelConfig, rules, layer: tuple, n_layers: int, rows: int,
                    part: str = "full") -> int:
    """VJP residual bytes of `n_layers` layers for `rows` token rows on one device,
    traced with `jax.eval_shape` (never run): the engine's own `apply_layers` and
    tensor-parallel plan, inside a shard_map over an abstract `tensor` mesh of `tp`
    devices, so weights and activations have their per-device shapes. `part`: "full"
    (the VJP of weights and input, what a fused backward keeps), or for a split
    backward (`framework/engine/split.py`) "input" (the input-gradient VJP's residuals),
    "saved" (the weight ops' inputs) or "douts" (the weight ops' output gradients).
    `layer`: (seq, tp, sp, remat), the sequence, tensor degree, sequence parallelism
    and remat policy the layers run with."""
    seq, tp, sp, remat = layer
    tp_plan = TensorParallel(TENSOR, tp, sp, rules)
    dt = jnp.dtype(model.dtype)
    found = {}

    def chunk_residuals():  # runs per device, at trace time only
        vary = (lambda a: jax.lax.pcast(a, TENSOR, to="varying")) if sp else (lambda a: a)
        x = vary(jnp.zeros((rows, seq // tp if sp else seq, model.d_model), dt))
        keys = jax.random.split(jax.random.key(0), n_layers)
        init = lambda k: nn.meta.unbox(Block(model, tp_plan).init(k, x[:1])["params"])
        weights = jax.tree.map(vary, jax.vmap(init)(keys))  # as the engine types them
        if part == "full":
            _, vjp_fn = jax.vjp(lambda w, x: apply_layers(model, w, x, remat, tp_plan), weights, x)
        else:
            y, vjp_fn, saved = split_layers(model, remat, tp_plan).forward(weights, x)
            if part != "input":
                found["bytes"] = nbytes(saved if part == "saved" else vjp_fn(y)[1])
                return jnp.zeros(())
        # The residual leaves, without the weights the VJP closes over (the split the
        # tick executor makes for its stash, framework/parallel/pipeline/ticks.py).
        found["bytes"] = nbytes(split_vjp(vjp_fn, weights)[0])
        return jnp.zeros(())

    mesh = AbstractMesh((tp,), (TENSOR,))
    jax.eval_shape(jax.shard_map(chunk_residuals, mesh=mesh, in_specs=(), out_specs=P()))
    return found["bytes"]


@dataclass(frozen=True)
class Residuals:
    """What one layer's backward keeps from its forward, per device: a part per token
    row (activations) and a part per layer (e.g. bfloat16 casts of its weights)."""

    per_row: int
    per_layer: int

    def chunk(self, n_layers: int, rows: int) -> int:
        return n_layers * (rows * self.per_row + self.per_layer)


def attention_traced(model: ModelConfig, seq: int, platform: str | None = None) -> ModelConfig:
    """The model with the attention kernel whose memory is predicted: `auto` resolved for
    `platform` (default: JAX's default backend), cudnn as blockwise (see the module
    docstring)."""
    impl = model.attention
    if impl == "auto":
        impl = attention.choose(platform or jax.default_backend(), model.dtype, seq,
                                model.head_dim)
    return dataclasses.replace(model, attention="blockwise" if impl == "cudnn" else impl)


def residuals(model: ModelConfig, seq: int, tp: int, sp: bool, remat: str,
              part: str = "full", rules=None) -> Residuals:
    """Four traces, (layers, rows) in {1, 2}^2, of r(L, b) = L*(b*x + y) + b*z + w. The
    layer-invariant z, w (the causal mask and other broadcast constants, which the
    layer scan hoists and XLA folds into their users) are not memory: dropped.
    `model.attention` must be resolved (`attention_traced`)."""
    rules = param_rules() if rules is None else rules
    r = {(n, b): _residual_bytes(model, rules, (seq, tp, sp, remat), n, b, part)
         for n in (1, 2) for b in (1, 2)}
    per_row = r[2, 2] - r[2, 1] - r[1, 2] + r[1, 1]
    return Residuals(per_row, r[2, 1] - r[1, 1] - per_row)


@lru_cache(maxsize=None)
def _param_bytes(model: ModelConfig, parallel: ParallelConfig,
                 n_chunks: int) -> tuple[int, int, int, int]:
    """Local float32 bytes per device: (all parameters, the same after ZeRO-1's
    sharding over `data`, the layers alone, the largest layer leaf), from the engine's
    own layout and rules (`framework/engine/state.py`)."""
    shapes = abstract_train_params(model, parallel.pipeline, n_chunks, parallel.stage_layers)
    degrees = {PIPE: parallel.pipeline, DATA: parallel.data, TENSOR: parallel.tensor, None: 1}
    is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)

    def sizes(tree_specs, group=None):
        for k in shapes if group is None else (group,):
            for shape, spec in zip(jax.tree.leaves(shapes[k]),
                                   jax.tree.leaves(tree_specs[k], is_leaf=is_spec)):
                yield math.prod(shape.shape) // math.prod(degrees[a] for a in spec) * FP32

    plain = param_specs(model, dataclasses.replace(parallel, zero1=False, fsdp=False),
                        n_chunks)[0]
    stored = param_specs(model, parallel, n_chunks)[0]
    return (sum(sizes(plain)), sum(sizes(stored)), sum(sizes(plain, "stages")),
            max(sizes(plain, "stages")))


# float32 [mb rows, seq, vocab/tensor] tensors alive at the LM head + loss's peak (logits,
# their exponentials, the logit gradients, ...), read from XLA's buffer assignment of
# llama_1b_8gpu's step: GPipe runs the head microbatch by microbatch after the tick loop
# (recomputing it in the backward; with one microbatch, directly), 1F1B inside it.
LOGIT_COPIES = {"whole_batch": 4, "per_microbatch": 2.5, "1f1b": 3}
# The GPU compiler fuses the head's softmax cross-entropy: at its peak it holds about 0.4
# of one such tensor, whatever the executor. Read from llama_1b_8gpu's 1F1B step on
# gpu:h100x8 (2026-11-26: compiled 11.28 GiB, the other terms 9.98 GiB, one float32
# logits tensor of a microbatch 3.91 GiB); checked on the other schedules and on
# llama3_8b in tests/compiled/test_aot.py.
GPU_LOGIT_COPIES = 0.4
# The TPU compiler fuses the cross-entropy and the logits' gradient into the head's
# matmuls: it holds one bfloat16 logits tensor of a microbatch, half a float32 one. Read
# from the buffer assignment of llama_1b_8gpu's 1F1B step on tpu:v5p-16 (2026-11-26).
TPU_LOGIT_COPIES = 0.5


def logit_copies(kind: str, platform: str | None) -> float:
    """Float32 logits tensors of one microbatch alive at the head's peak (`kind` as in
    LOGIT_COPIES) on `platform` (default: JAX's default backend)."""
    fused = {"gpu": GPU_LOGIT_COPIES, "tpu": TPU_LOGIT_COPIES}
    return fused.get(platform or jax.default_backend(), LOGIT_COPIES[kind])
# [rows, seq, embed] tensors of the whole local batch GPipe keeps: the embedded inputs,
# the pipeline's outputs, and their gradients.
GPIPE_BATCH_COPIES = 4
# The TPU compiler's autodiff tick scan (GPipe, circular), read from the buffer
# assignments of llama_1b_8gpu's GPipe and circular (v=2) steps on tpu:v5p-16
# (2026-11-26, seventh; within 0.01 GiB of its peaks): two batch-sized tensors alive at
# the backward's peak (the gradients of the pipeline's inputs and outputs) and with
# several chunks a rank a third (the gradient of the buffer that holds the microbatches
# between passes); the chunk weights a tick saves are their cast to the compute dtype
# (with one chunk: the stage's cast, kept once); the gradient accumulator is one
# chunk's, not the stage's.
TPU_BATCH_COPIES = 2
# The TPU compiler fuses more of a layer's backward: it holds 0.41 of what the model
# counts (its residuals without remat and the attention kernel's score blocks): 0.84
# against 2.04 GiB in the same two programs and in llama_1b_8gpu's 1F1B step (1.34 held
# against 2.54 with the stash slot). Checked on llama3_8b_v5p and llama3_70b_v5p, which
# were not read: every schedule 0.96-1.01 of the compiler (docs/compile.md).
TPU_LAYER_BACKWARD = 0.41
# float32 attention-score tensors one layer's backward holds beyond its residuals, read
# from XLA's buffer assignment (compiled peak - prediction, seq 1024-8192): dense, the
# score gradient [mb, heads, seq, seq] (1.1-1.2 of it); blockwise, one block's scores,
# probabilities and their gradients [mb, heads, block_q, block_kv] (about 4).
ATTENTION_SCORE_COPIES = {"dense": 1.2, "blockwise": 4}


def attention_scores_bytes(model: ModelConfig, rows: int, seq: int, tp: int) -> float:
    """The attention kernel's transient in one layer's backward (`model.attention`
    resolved, see `attention_traced`), bytes per device."""
    bq, bk = seq, seq
    if model.attention == "blockwise":
        bq, bk = min(model.attention_block_q, seq), min(model.attention_block_kv, seq)
    heads = model.n_heads // tp
    return ATTENTION_SCORE_COPIES[model.attention] * rows * heads * bq * bk * FP32


def _layer_remat(parallel: ParallelConfig) -> str:
    """The remat policy the layers run under: FSDP gathering per use runs no remat as
    save_dots (framework/model/llama.py, `checkpointed`)."""
    return "save_dots" if gathers_per_use(parallel) and parallel.remat == "none" \
        else parallel.remat


def _widths(optim: OptimConfig) -> tuple[float, float]:
    """Bytes per float32 byte: of a stored parameter or gradient, of AdamW's two moments."""
    return (jnp.dtype(optim.param_dtype).itemsize / FP32,
            (jnp.dtype(optim.mu_dtype).itemsize + FP32) / FP32)


def _autodiff_kept(res: Residuals, ticks: int, layers: int, mb_rows: int, v: int,
                   stage_weights: int, batch_hidden: float, cast: float | None) -> float:
    """What autodiff's tick scan keeps until its backward: every forward tick's
    residuals, the loop-invariant part once, and GPipe's batch-sized copies. `cast`:
    None, or (TPU) the compute dtype's bytes per float32 byte (TPU_BATCH_COPIES)."""
    per_tick = layers * mb_rows * res.per_row
    fixed = layers * res.per_layer  # loop-invariant over ticks: kept once
    copies = GPIPE_BATCH_COPIES
    weights = stage_weights // v  # the chunk's weights, float32 bytes
    if cast is not None:  # TPU: the weights' cast kept, not the float32 weights
        weights *= cast
        fixed += 0 if v > 1 else weights  # one chunk: the stage's cast, once
        copies = TPU_BATCH_COPIES + (v > 1)
    if v > 1:  # the chunk's weights are sliced per tick (dynamic index): saved per tick
        per_tick += fixed + weights
    return ticks * per_tick + fixed + copies * batch_hidden


def _layer_backward(model: ModelConfig, seq: int, tp: int, sp: bool, rules, mb_rows: int,
                    tpu: bool) -> float:
    """One layer's backward in flight: its residuals once more (recomputed under
    remat) and the attention kernel's score blocks; the TPU's fused backward holds
    TPU_LAYER_BACKWARD of that."""
    held = residuals(model, seq, tp, sp, "none", rules=rules).chunk(1, mb_rows)
    held += attention_scores_bytes(model, mb_rows, seq, tp)
    return held * TPU_LAYER_BACKWARD if tpu else held


def _zero1_gathered(full: int, stored: int, stage_weights: int, cast: float | None,
                    v: int) -> float:
    """ZeRO-1's gathered parameters (0 without ZeRO-1), float32 bytes; the TPU compiler
    (`cast` not None) casts the layers' weights before their all-gather (llama3_70b_v5p
    at pp8-dp4-tp2, interleaved: every layer matrix gathered in bfloat16, 2026-11-26),
    so they are held in the compute dtype. With one chunk a rank they take the place of
    the stage's cast that the TPU program holds anyway (`_autodiff_kept`'s `fixed`, the
    tick executor's per-layer residuals): ZeRO-1 adds only the embedding and head
    gathered (compiled, ZeRO-1 on against off, 1F1B: llama3_70b_v5p +0.98 GiB, its
    embedding's float32 shard; llama_1b_8gpu on tpu:v5p-16 +0.50, likewise; 2026-11-27)."""
    if stored == full:
        return 0
    if cast is not None and v == 1:
        return full - stage_weights
    return full - (stage_weights * (1 - cast) if cast is not None else 0)


def _tick_kept(state: dict) -> float:
    """The tick executor's state (`executor_state`: with a split backward and a pair
    of ticks a step, B's douts held for the next tick too) + with overlapped sends the
    message arriving beside the cell, one per pending one."""
    return state["recv"] + state["stash"] + state["saved"] + 2 * state["pending"] + \
        state["held"]


def _layer_extras(model: ModelConfig, parallel: ParallelConfig, split_backward: bool,
                  backward: float, layer_weights: float, layer_leaf: float,
                  width: float) -> float:
    """One layer's backward in a tick cell with what some layouts add (float32 bytes of
    one layer's weights and largest leaf; read from llama3_405b's buffer assignment on
    gpu:h100x1024): collective matmuls' weight gradients, one partial per ring step in
    the compute dtype, summed only at the layer's end when its residuals are mostly
    spent (the split backward keeps plain collectives, framework/parallel/tensor.py);
    uneven stages run each layer under a cond (`stage.skip_unless`): its weights sliced
    out of the chunk (a copy) and its largest gradient leaf returned apart."""
    tp = parallel.tensor
    if parallel.sequence_parallel and parallel.collective_matmul and tp > 1 \
            and not split_backward:
        backward = max(backward, tp * layer_weights * np.dtype(model.dtype).itemsize / FP32)
    if parallel.stage_layers is not None:
        backward += (layer_weights + layer_leaf) * width
    return backward


def _tick_gradients(state: dict, grads: float, backward: float, per_use: bool, v: int,
                    width: float, gathered: float, stored: int, stage_weights: int,
                    layer_leaf: int) -> tuple[float, float]:
    """The tick executor's (gradients, layer-backward transient), read from the GPU
    compiler's buffer assignments of llama_1b_8gpu (1F1B, gpu:h100x8) and llama3_70b
    (5 chunks a rank, gpu:h100x64); float32 bytes of `_param_bytes` (`width`: a stored
    parameter's share of float32's), `grads` what the caller counted so far, `gathered`
    ZeRO-1's gathered parameters (0 without)."""
    if per_use:  # FSDP: the sharded gradients and the loop's accumulators
        return grads + state["grads"], backward
    # the accumulators (which the reductions after the loop reuse) and the cell's fresh
    # gradients of its chunk, carried through the layer scan
    chunk = stage_weights / v
    grads = state["grads"] + chunk + gathered
    if v > 1:  # the cell slices its chunk's weights (a dynamic index: a copy) and adds
        # into the stacked accumulators in place
        backward += chunk * width
    else:  # a[0] += g is out of place: old and new accumulators side by side, beside
        # the leaf being added
        backward = max(backward, (state["grads"] + layer_leaf - chunk) * width)
    if gathered:  # ZeRO-1, before the loop: the accumulators' zeros and the
        # gathered parameters beside the shards transposed for the gather
        backward = max(backward, (stored - chunk) * width)
    return grads, backward


def predict_memory(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                   platform: str | None = None, optim: OptimConfig | None = None) -> dict:
    """Predicted bytes per device at the step's peak, by term (see the module
    docstring); 'total' sums them. `platform` decides what `model.attention=auto` runs
    (default: JAX's default backend); `optim` the stored dtypes (default float32)."""
    stored_width, moments_width = _widths(optim or OptimConfig())
    model = attention_traced(model, train.seq_len, platform)
    parallel = resolve_stage_layers(model, parallel, train.seq_len)  # auto -> counts
    dp, tp, m = parallel.data, parallel.tensor, parallel.microbatches
    sched = program_of(parallel, model.n_layers).schedule
    v = sched.n_chunks  # chunks a rank holds
    full, stored, stage_weights, layer_leaf = _param_bytes(model, parallel, v)
    rules = param_rules(parallel.tensor_split)
    rows = train.global_batch_size // dp  # this data replica's rows
    mb_rows = rows // m  # a microbatch's
    sp = parallel.sequence_parallel and tp > 1
    seq = train.seq_len // parallel.context  # a device's tokens of a sequence (context)
    hidden = mb_rows * (seq // tp if sp else seq) * model.d_model * np.dtype(model.dtype).itemsize
    logits = seq * (model.vocab_size // tp) * FP32  # per row
    per_use = gathers_per_use(parallel)
    res = residuals(model, seq, tp, sp, _layer_remat(parallel), rules=rules)
    layers = max(stage_layer_counts(model, parallel, train.seq_len))  # per chunk (padded)
    tpu = (platform or jax.default_backend()) == "tpu"
    cast = np.dtype(model.dtype).itemsize / FP32 if tpu else None
    layer_backward = _layer_backward(model, seq, tp, sp, rules, mb_rows, tpu)
    gathered = _zero1_gathered(full, stored, stage_weights, cast, v)
    grads = full + gathered
    if per_use:  # FSDP: gradients sharded, nothing gathered for the step; one layer's
        # float32 weights gathered at a time, their cast and their gradient beside them
        grads = stored
        layer_backward += 3 * stage_weights / (v * layers)
    if sched.executor == AUTODIFF:  # every forward tick's residuals, until the backward
        ticks = sched.forward_rows().n_ticks
        kept = _autodiff_kept(res, ticks, layers, mb_rows, v, stage_weights, hidden * m, cast)
        head = logit_copies("per_microbatch" if m > 1 else "whole_batch", platform) * logits * mb_rows
        backward = layer_backward
        if ticks > 1:  # the tick scan's backward: one tick's slice of the residual
            backward += res.chunk(layers, mb_rows)  # stack, and a gradient accumulator
            grads += stage_weights / (dp if per_use else 1) / (v if tpu else 1)  # for
            # the stage's weights (TPU: the chunk's)
    else:  # tick executor: its own state (receive slots, stash, gradient accumulators)
        state = executor_state(model, parallel, train.global_batch_size, train.seq_len,
                               platform)
        slot, kept = state["slot"], _tick_kept(state)
        head = logit_copies("1f1b", platform) * logits * mb_rows
        backward = _layer_extras(model, parallel, sched.split_backward, layer_backward + slot,
                                 stage_weights / (v * layers), layer_leaf / (v * layers),
                                 stored_width)  # (a forward's new slot is built apart)
        grads, backward = _tick_gradients(state, grads, backward, per_use, v, stored_width,
                                          gathered, stored, stage_weights, layer_leaf)
    out = {
        "params": stored * stored_width,
        "optimizer": moments_width * stored,  # AdamW's mu and nu, sharded like the params
        "tokens": rows * (train.seq_len + 1) * 4,
        "gradients": grads * stored_width,
        "activations": kept,
        "transient": max(head, backward),  # the head's peak and the layers' do not overlap
    }
    out["total"] = sum(out.values())
    return out
