"""One microbatch's transients outside the layers, in bytes per device: the head and the
loss (its logits, or one chunk's with `model.loss_chunk`) and the attention kernel's
scores in one layer's backward. `memory_model.predict_memory` adds them to what is kept;
each count of copies is a row of `fitted.py`, read from the compilers' buffers."""
from __future__ import annotations

import jax

from framework.analysis.fitted import fitted
from framework.config import ModelConfig
from framework.engine.resolved import Layout
from framework.model.loss import chunk_count
from framework.units import FP32


def head_bytes(lay: Layout, kind: str, platform: str | None) -> float:
    """The head + loss's peak, one microbatch on one device (`kind`: `logit_copies`'s):
    the microbatch's logits tensors, or with `model.loss_chunk` one chunk's beside the
    head's float32 weight-gradient sum and cast weights (framework/model/loss.py)."""
    tokens, chunk = lay.rows_per_microbatch * lay.seq_per_device, lay.model.loss_chunk
    vocab = lay.model.vocab_size // lay.parallel.tensor
    if not chunk or chunk >= tokens:
        return logit_copies(kind, platform) * tokens * vocab * FP32
    chunk_tokens = tokens // chunk_count(tokens, chunk)
    return (fitted("logit_copies/chunk") * chunk_tokens
            + fitted("head_weight_copies/chunk") * lay.model.d_model) * vocab * FP32


def logit_copies(kind: str, platform: str | None) -> float:
    """Float32 logits tensors of one microbatch alive at the head's peak (`kind`:
    whole_batch, per_microbatch or 1f1b) on `platform` (default: JAX's default
    backend): the GPU and TPU compilers fuse the head whatever the executor."""
    platform = platform or jax.default_backend()
    return fitted(f"logit_copies/{platform if platform in ('gpu', 'tpu') else kind}")


def attention_scores_bytes(model: ModelConfig, rows: int, seq: int, tp: int) -> float:
    """The attention kernel's transient in one layer's backward (`model.attention`
    resolved, see `attention_traced`), bytes per device."""
    bq, bk = seq, seq
    if model.attention == "blockwise":
        bq, bk = min(model.attention_block_q, seq), min(model.attention_block_kv, seq)
    heads = model.n_heads // tp
    return fitted(f"score_copies/{model.attention}") * rows * heads * bq * bk * FP32
