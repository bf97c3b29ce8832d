"""Model FLOPs per token and accelerator peaks, for TFLOP/s per device and MFU.

Model FLOPs per trained token, PaLM (Chowdhery et al. 2022), appendix B:

    6 * N  +  12 * L * H * Q * T

6N: every parameter that takes part in a matmul costs 2 FLOPs per token forward and 4
backward (N here: all layer weights plus the LM head; the embedding lookup is a
gather, not a matmul; a tied table counts once, as the head). 12*L*H*Q*T: attention
scores and the weighted sum of values (2 matmuls of T x Q per head per token, forward
and backward), L layers, H heads of size Q (`model.head_dim`: d_model / H unless
`model.explicit_head_dim` sets it, as Qwen3 does), sequence length T.
Like PaLM we count the full T x T score matrix, not the causal half, and count no
rematerialisation: these are *model* FLOPs, so MFU compares layouts fairly. A layer
with a sliding window w (Mistral, Gemma 2's local layers) counts T x min(w, T): each
query's window of keys in place of all T.

MFU = achieved model FLOP/s per device / the device's peak dense FLOP/s for the
compute dtype. The peaks are vendors' dense (no sparsity) figures per chip; float32
compute on NVIDIA GPUs runs matmuls in TF32 by default in XLA, so it is compared with
the TF32 peak. Unknown devices (CPU, or float32 on TPU) give None, logged as null.
"""

from __future__ import annotations

from framework.config import ModelConfig
from framework.model.llama import count_params, keys_per_query

# (substring of the lower-cased jax device_kind, {dtype: peak FLOP/s per chip}),
# checked in order: the first match wins.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h200", {"bfloat16": 989.4e12, "float32": 494.7e12}),
    ("h100 pcie", {"bfloat16": 756.0e12, "float32": 378.0e12}),
    ("h100", {"bfloat16": 989.4e12, "float32": 494.7e12}),  # SXM5
    ("a100", {"bfloat16": 312.0e12, "float32": 156.0e12}),
    ("tpu v5 lite", {"bfloat16": 197.0e12}),  # v5e
    ("tpu v5e", {"bfloat16": 197.0e12}),
    ("tpu v5p", {"bfloat16": 459.0e12}),
    ("tpu v5", {"bfloat16": 459.0e12}),  # v5p reports itself as "TPU v5"
    ("tpu v4", {"bfloat16": 275.0e12}),
)


def matmul_params(model: ModelConfig) -> int:
    """N of the 6N term: parameters used in matmuls (layers and LM head)."""
    embedding_lookup = 0 if model.tie_embeddings else model.vocab_size * model.d_model
    return count_params(model) - embedding_lookup


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) model FLOPs per token, PaLM appendix B; keys per
    query: seq_len, or the window on local layers."""
    attention = 12 * model.n_heads * model.head_dim * sum(keys_per_query(model, seq_len))
    return float(6 * matmul_params(model) + attention)


def peak_flops_per_device(device_kind: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of one device for `dtype` compute, or None if unknown."""
    kind = device_kind.lower()
    for key, peaks in PEAK_FLOPS:
        if key in kind:
            return peaks.get(dtype)
    return None


def throughput(tokens_per_sec: float, n_devices: int, flops_token: float,
               peak: float | None) -> dict:
    """The perf/* numbers derived from a measured token rate."""
    per_device = flops_token * tokens_per_sec / n_devices  # FLOP/s
    return {
        "perf/tokens_per_sec": tokens_per_sec,
        "perf/tokens_per_sec_per_device": tokens_per_sec / n_devices,
        "perf/tflops_per_device": per_device / 1e12,
        "perf/mfu": None if peak is None else per_device / peak,
    }
