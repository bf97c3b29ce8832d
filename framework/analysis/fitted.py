"""The memory model's constants that are not traced, each with where it was read: a
count of batch- or logits-sized tensors that XLA's buffer assignment holds at a peak
the model cannot trace (the compilers fuse and schedule differently). One row each,
with the program, the target, the jaxlib and the date it was read from, and what it
was checked against since; `framework/analysis/memory_model.py` reads them here, and
`tests/unit/test_fitted.py` checks every row is complete and read.

Adding a constant: a row here with its provenance, never a bare number in the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fitted:
    value: float
    what: str  # what the count is of
    program: str  # the recipe and schedule whose buffer assignment it was read from
    target: str  # the compile target (the compiler's)
    jaxlib: str
    date: str
    checked: str = ""  # what else it has been checked against


_1B_8GPU = "llama_1b_8gpu"
FITTED: dict[str, Fitted] = {
    # float32 [mb rows, seq, vocab/tensor] tensors alive at the LM head + loss's peak
    # (logits, their exponentials, the logit gradients, ...)
    "logit_copies/whole_batch": Fitted(
        4, "logits tensors at the head's peak, one microbatch (GPipe, directly)",
        f"{_1B_8GPU} gpipe m=1", "cpu", "0.10.2", "2026-11-21"),
    "logit_copies/per_microbatch": Fitted(
        2.5, "logits tensors at the head's peak: GPipe's head microbatch by microbatch "
        "after the tick loop (recomputed in the backward)", f"{_1B_8GPU} gpipe",
        "cpu", "0.10.2", "2026-11-21"),
    "logit_copies/1f1b": Fitted(
        3, "logits tensors at the head's peak inside the tick loop",
        f"{_1B_8GPU} 1f1b", "cpu", "0.10.2", "2026-11-21"),
    # The GPU compiler fuses the head's softmax cross-entropy: about 0.4 of one tensor
    # (compiled 11.28 GiB, the other terms 9.98 GiB, one float32 logits tensor of a
    # microbatch 3.91 GiB), whatever the executor.
    "logit_copies/gpu": Fitted(
        0.4, "logits tensors at the head's peak, GPU compiler (fused cross-entropy)",
        f"{_1B_8GPU} 1f1b", "gpu:h100x8", "0.10.2", "2026-11-26",
        "the other schedules and llama3_8b (tests/compiled/test_aot.py)"),
    # The TPU compiler fuses the cross-entropy and the logits' gradient into the head's
    # matmuls: one bfloat16 logits tensor of a microbatch, half a float32 one.
    "logit_copies/tpu": Fitted(
        0.5, "logits tensors at the head's peak, TPU compiler", f"{_1B_8GPU} 1f1b",
        "tpu:v5p-16", "0.10.2", "2026-11-26"),
    # The loss in chunks (model.loss_chunk, framework/model/loss.py), read from the
    # optimized program's buffers (not its peak, which is elsewhere: 2048- and
    # 3072-token chunks both compile to 62.56 GiB at 9 rows): the scan body's logits
    # and their gradient, both bfloat16 (one float32 chunk's worth); beside the scan
    # the float32 weight-gradient sum and the weights' bfloat16 cast, transposed.
    "logit_copies/chunk": Fitted(
        1.0, "float32 [chunk, vocab/tensor] tensors in the chunked loss's scan body",
        "llama_1b_1gpu model.loss_chunk=2048", "gpu:h100x1", "0.10.2",
        "2026-11-28"),
    "head_weight_copies/chunk": Fitted(
        1.5, "float32 [embed, vocab/tensor] tensors beside the chunked loss's scan "
        "(the weight-gradient sum, the weights' bfloat16 cast)",
        "llama_1b_1gpu model.loss_chunk=2048", "gpu:h100x1", "0.10.2", "2026-11-28"),
    # [rows, seq, embed] tensors of the whole local batch GPipe keeps: the embedded
    # inputs, the pipeline's outputs, and their gradients.
    "batch_copies/gpipe": Fitted(
        4, "batch-sized hidden-state tensors autodiff's tick scan keeps",
        f"{_1B_8GPU} gpipe", "cpu", "0.10.2", "2026-11-21"),
    # The TPU's autodiff tick scan: the gradients of the pipeline's inputs and outputs at
    # the backward's peak; with several chunks a rank a third (the gradient of the
    # buffer holding the microbatches between passes). Within 0.01 GiB of the peaks.
    "batch_copies/tpu": Fitted(
        2, "batch-sized tensors at the TPU autodiff scan's backward peak (+1 with "
        "several chunks a rank)", f"{_1B_8GPU} gpipe and circular v=2", "tpu:v5p-16",
        "0.10.2", "2026-11-26"),
    # The TPU compiler fuses more of a layer's backward: 0.84 against 2.04 GiB in the
    # same two programs and in the 1F1B step (1.34 against 2.54 with the stash slot).
    "layer_backward/tpu": Fitted(
        0.41, "share of a layer's backward (residuals without remat + score blocks) the "
        "TPU compiler holds", f"{_1B_8GPU} gpipe, circular, 1f1b", "tpu:v5p-16",
        "0.10.2", "2026-11-26",
        "llama3_8b_v5p, llama3_70b_v5p: every schedule 0.96-1.01 (docs/compile.md)"),
    # float32 attention-score tensors one layer's backward holds beyond its residuals
    # (compiled peak - prediction, seq 1024-8192)
    "score_copies/dense": Fitted(
        1.2, "[mb, heads, seq, seq] score-gradient tensors (dense attention)",
        "tests/compiled/test_memory.py layouts, seq 1024-8192", "cpu", "0.10.2",
        "2026-11-23"),
    "score_copies/blockwise": Fitted(
        4, "[mb, heads, block_q, block_kv] tensors (one block's scores, probabilities "
        "and their gradients)", "tests/compiled/test_memory.py layouts, seq 1024-8192",
        "cpu", "0.10.2", "2026-11-23"),
}


def fitted(name: str) -> float:
    """The value of one fitted constant (a KeyError names a constant that has no row)."""
    return FITTED[name].value
