"""Causal grouped-query attention kernels, as plain functions of q, k, v, which keys
each query sees (`Mask`) and how scores are made (`ScoreForm`; both defined in
framework/model/blockwise.py). The model (`framework/model/llama.py`) calls `attend`
with its `ModelConfig` (the kernel, `model.attention`, and its block sizes); nothing
here knows about meshes, so under tensor parallelism each device simply runs its own
heads.

Shapes (grouped-query attention, Ainslie et al. 2023: the r query heads of a group share
one key/value head, which is never repeated):

    q: [batch, q_len, kv_heads, r, head_dim]     k, v: [batch, kv_len, kv_heads, head_dim]
    out: like q

Positions (`Mask`): query i sits at q_offset + i, key j at kv_offset + j, and a query
attends the keys at or before its position (causal). Training uses 0 and 0; a decode
step with a cache passes the cache position as q_offset. Offsets may be Python ints or
traced int32 scalars. Scores are scaled by 1/sqrt(head_dim) (Vaswani et al. 2017), or by the
model's own scale, and soft-capped where the model says (`ScoreForm`, `score_form`).

Sliding window (Mistral, Gemma 2's local layers; transformers' masking_utils.py:
`kv_idx > q_idx - sliding_window`): with `window` w a query sees only the keys fewer
than w positions before it, besides causality and documents. `window` may be a traced
int32 scalar (a per-layer window scanned with the layers); None: no window.

Document masks (framework/model/documents.py): `segments=(seg_q [b, q_len], seg_k
[b, kv_len])` int32 makes a key visible only to the queries of its own segment as well.

    dense      the reference: all [q_len, kv_len] scores at once, softmax in float32.
    blockwise  online softmax over key blocks (framework/model/blockwise.py; Milakov &
               Gimelshein 2018; Rabe & Staats 2021; FlashAttention, Dao et al. 2022):
               per query block, running max m,
               sum l and output accumulator in float32; key blocks wholly above the
               causal diagonal are never visited. The backward is a custom VJP that
               recomputes each block's probabilities from the saved log-sum-exp
               (FlashAttention-2, Dao 2023): memory linear in the sequence, no
               [q_len, kv_len] tensor in either direction. Block sizes need not divide
               the lengths (the tail block is padded and masked).
    cudnn      cuDNN's fused flash attention through `jax.nn.dot_product_attention`
               (NVIDIA GPUs, bfloat16/float16, head_dim a multiple of 8, <= 128).
    auto       `choose`: cudnn where it is available and supports the shape, else dense
               up to DENSE_MAX_SEQ keys and blockwise beyond (measured, see docs/performance.md).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from framework.config import CHOICES, ModelConfig, not_one_of
from framework.errors import ConfigError
from framework.model.blockwise import (ATTENDED, PLAIN, Blocks, Mask, ScoreForm, blockwise_attention,
                                       zeros_varying_like)
from framework.model.documents import visible
from framework.model.fused_pieces import CAUSAL, CUDNN, REFERENCE, FusedPiece

IMPLEMENTATIONS = CHOICES["model.attention"]
# Up to this many keys `auto` picks dense on CPU/TPU (and on GPUs without cuDNN support).
# Measured on the 2-core development CPU (docs/performance.md): blockwise/dense step time
# 1.14 at seq 128, 1.16 at 512, 0.87 at 1024, 0.39 at 2048 (and a third of the memory).
DENSE_MAX_SEQ = 512
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128  # 256 on Hopper and later; 128 holds everywhere


def _gpu_platform(platform: str) -> bool:
    return platform in ("gpu", "cuda")


def cudnn_unsupported(dtype, head_dim: int) -> str | None:
    """Why cuDNN's fused attention cannot run this shape (None: it can)."""
    if jnp.dtype(dtype).name not in CUDNN_DTYPES:
        return (f"cuDNN's fused attention needs bfloat16 or float16 compute, not "
                f"{jnp.dtype(dtype).name}")
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return (f"cuDNN's fused attention needs a head dim that is a multiple of 8 and at most "
                f"{CUDNN_MAX_HEAD_DIM}, not {head_dim}")
    return None


def check_platform(model, platform: str) -> None:
    """A one-line ConfigError when `model.attention` cannot run on `platform` (checked
    once the devices are known, before anything is compiled)."""
    if model.attention == "cudnn" and not _gpu_platform(platform):
        raise ConfigError(f"model.attention=cudnn needs an NVIDIA GPU (cuDNN), and this run "
                          f"is on {platform}: use model.attention=auto, dense or blockwise")


def check_settings(model) -> list[str]:
    """Problems of `model.attention` and its block sizes (whatever the platform)."""
    problem = not_one_of("model.attention", model.attention)
    if problem:
        return [problem]
    errs = [f"model.{name}={getattr(model, name)} must be >= 1"
            for name in ("attention_block_q", "attention_block_kv") if getattr(model, name) < 1]
    if model.attention == "cudnn" and model.dtype not in ("bfloat16",):
        errs.append(f"model.attention=cudnn needs model.dtype=bfloat16 (cuDNN's fused "
                    f"attention has no {model.dtype} kernel): use model.attention=auto, "
                    f"dense or blockwise")
    if model.attention == "cudnn" and getattr(model, "attn_softcap", None) is not None:
        errs.append(f"model.attention=cudnn cannot soft-cap scores (model.attn_softcap="
                    f"{model.attn_softcap}; cuDNN's fused attention has no soft-cap): use "
                    f"model.attention=auto, dense or blockwise")
    if model.attention == "cudnn" and getattr(model, "sliding_window_pattern", 0) \
            and getattr(model, "sliding_window", None):
        errs.append(f"model.attention=cudnn needs one window on every layer (cuDNN's window "
                    f"is static), not model.sliding_window_pattern="
                    f"{model.sliding_window_pattern}: use model.attention=auto or blockwise")
    width_known = model.explicit_head_dim or (model.n_heads and
                                              model.d_model % model.n_heads == 0)
    if model.attention == "cudnn" and width_known and (model.head_dim % 8 or
                                                       model.head_dim > CUDNN_MAX_HEAD_DIM):
        errs.append(f"model.attention=cudnn needs a head width (model.explicit_head_dim, else "
                    f"d_model/n_heads) that is a multiple of 8 and at most "
                    f"{CUDNN_MAX_HEAD_DIM}, not {model.head_dim}: use model.attention=auto "
                    f"or blockwise")
    return errs


def choose(platform: str, dtype, kv_len: int, head_dim: int, no_cudnn: bool = False) -> str:
    """What `auto` runs: cudnn on NVIDIA GPUs when supported (not `no_cudnn`: a soft-cap
    or a per-layer (traced) window, which cuDNN's kernel lacks, or document masks, which
    JAX hands cuDNN as a [batch, 1, q_len, kv_len] bias: quadratic memory), else dense
    for short sequences and blockwise (linear memory) for long ones."""
    if (_gpu_platform(platform) and not no_cudnn
            and cudnn_unsupported(dtype, head_dim) is None):
        return "cudnn"
    return "dense" if kv_len <= DENSE_MAX_SEQ else "blockwise"


def score_form(model: ModelConfig) -> ScoreForm:
    """The model's scores: scaled by query_pre_attn_scalar^-1/2 where it is set (Gemma 2's
    `scaling`, transformers' modeling_gemma2.py), soft-capped by model.attn_softcap."""
    scalar = getattr(model, "query_pre_attn_scalar", None)
    return ScoreForm(None if scalar is None else float(scalar) ** -0.5,
                     getattr(model, "attn_softcap", None))


def attend(q, k, v, model: ModelConfig, *, q_offset=0, platform: str | None = None,
           segments=None, window=None):
    """Causal attention by `model.attention` (one of IMPLEMENTATIONS), blockwise with
    `model.attention_block_q` queries and `model.attention_block_kv` keys per block.
    The keys start at position 0 (the queries' own sequence, or a decode cache from its
    start), the queries at `q_offset`; `segments`: the queries' and keys' document ids,
    or None; `window`: the sliding window, or None (`Mask`). `platform` resolves `auto`
    (default: JAX's default backend)."""
    implementation, form = model.attention, score_form(model)
    mask = Mask(q_offset, 0, segments, window)
    if implementation == "auto":
        implementation = choose(platform or jax.default_backend(), q.dtype, k.shape[1],
                                q.shape[-1], form.softcap is not None or segments is not None
                                or not (window is None or isinstance(window, int)))
    if implementation == "dense":
        return dense_attention(q, k, v, mask=mask, form=form)
    if implementation == "blockwise":
        blocks = Blocks(model.attention_block_q, model.attention_block_kv)
        return blockwise_attention(q, k, v, mask=mask, form=form, blocks=blocks)
    if implementation == "cudnn":
        return cudnn_attention(q, k, v, mask=mask, scale=form.scale)
    raise ValueError(f"attention implementation {implementation!r} is not one of "
                     f"{', '.join(IMPLEMENTATIONS)}")


def _causal_mask(q_len: int, kv_len: int, mask: Mask):
    """[q_len, kv_len] bool: key position <= query position (and, with a window, fewer
    than `mask.window` before it); with segments [b, q_len, kv_len], and the key in the
    query's document."""
    q_pos = mask.q_offset + jnp.arange(q_len, dtype=jnp.int32)
    kv_pos = mask.kv_offset + jnp.arange(kv_len, dtype=jnp.int32)
    causal = kv_pos[None, :] <= q_pos[:, None]
    if mask.window is not None:
        causal = causal & (q_pos[:, None] - kv_pos[None, :] < mask.window)
    return causal if mask.segments is None else causal[None] & visible(*mask.segments)


# ---------------------------------------------------------------------------------
# dense: the reference.


def dense_attention(q, k, v, *, mask: Mask = Mask(), form: ScoreForm = PLAIN):
    """All scores at once: [batch, kv_heads, r, q_len, kv_len] float32, in `form`,
    masked with the smallest finite float (a query with no visible key averages every
    value)."""
    scores = jnp.einsum("bsgrk,btgk->bgrst", q, k).astype(jnp.float32) * form.of(q.shape[-1])
    if form.softcap is not None:  # c tanh(s / c), Gemma 2 (transformers' modeling_gemma2.py)
        scores = form.softcap * jnp.tanh(scores / form.softcap)
    seen = _causal_mask(q.shape[1], k.shape[1], mask)
    seen = seen if mask.segments is None else seen[:, None, None]  # [b, 1, 1, s, t]
    scores = jnp.where(seen, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bgrst,btgk->bsgrk", probs, v)


# ---------------------------------------------------------------------------------
# cudnn: NVIDIA's fused kernel.


def cudnn_attention(q, k, v, *, mask: Mask = Mask(), scale: float | None = None,
                    implementation: str = "cudnn"):
    """cuDNN flash attention. GQA is native (query heads [kv_heads * r] in group-major
    order, keys and values with kv_heads heads). With equal static offsets and lengths
    (training) the causal mask is cuDNN's own, which skips the masked blocks, and so is
    a static window (`local_window_size`, (window - 1) keys back, 0 ahead); other
    offsets and traced windows pass the mask explicitly, and so do document masks
    ([b, 1, s, t], which JAX hands cuDNN as an additive bias beside its causal mask).
    No soft-cap: cuDNN's kernel has none (`check_settings` refuses it). `scale`: the
    scores' (None: 1/sqrt(head_dim)).
    `implementation="xla"` runs the same call with XLA's kernel (how the tests check
    this wrapper on CPU)."""
    b, s, g, r, hd = q.shape
    flat = q.reshape(b, s, g * r, hd)  # head g*r + j: query j of group g, as JAX's GQA expects
    window = mask.window
    aligned = (isinstance(mask.q_offset, int) and isinstance(mask.kv_offset, int)
               and mask.q_offset == mask.kv_offset and s == k.shape[1]
               and (window is None or isinstance(window, int)))
    if aligned and window is None and mask.segments is None:  # plain causal: `_attended`
        kernel = CUDNN if implementation == "cudnn" else REFERENCE
        return _attended(FusedPiece(kernel, CAUSAL, scale or hd ** -0.5), q, k, v)
    if aligned:
        seen = None if mask.segments is None else visible(*mask.segments)[:, None]
    else:
        seen = _causal_mask(s, k.shape[1], mask)
        seen = seen[None, None] if mask.segments is None else seen[:, None]
    fused = _Fused(implementation, aligned, window - 1 if aligned and window else None, scale)
    return _fused(fused, flat, k, v, seen).reshape(b, s, g, r, hd)


class _Fused(NamedTuple):
    """The fused call's static settings."""

    implementation: str
    is_causal: bool
    back: int | None  # keys visible before the query's own (cuDNN's window), or None
    scale: float | None


def _fused_call(fused: _Fused, q, k, v, mask):
    window = None if fused.back is None else (fused.back, 0)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=fused.is_causal,
                                       scale=fused.scale, local_window_size=window,
                                       implementation=fused.implementation)
    return out + zeros_varying_like((), q, k, v).astype(out.dtype)  # typed like q, k, v in a shard_map


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(fused, q, k, v, mask):
    """The fused kernel behind a VJP of our own: its residuals are q, k, v (typed like
    the inputs inside a shard_map) and its backward differentiates the fused call
    again (cuDNN's backward kernel, after one more forward). The pipeline executors
    trace `jax.vjp` of a stage inside an outer differentiation and stash the
    residuals of a stage by type, which cuDNN's own residuals do not survive."""
    return _fused_call(fused, q, k, v, mask)


def _fused_fwd(fused, q, k, v, mask):
    return _fused_call(fused, q, k, v, mask), (q, k, v, mask)


def _fused_bwd(fused, residuals, d_out):
    q, k, v, mask = residuals
    call = lambda q, k, v: _fused_call(fused, q, k, v, mask)
    return (*jax.vjp(call, q, k, v)[1](d_out), None)


_fused.defvjp(_fused_fwd, _fused_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attended(piece: FusedPiece, q, k, v):
    """Causal fused attention whose backward is cuDNN's backward kernel on the forward's
    own output and log-sum-exp (JAX's VJP of the same call, its residuals ours: the
    cuDNN calls of framework/model/fused_pieces.py), named `ATTENDED` so `save_dots`
    keeps them: its backward then runs no attention forward at all, where `_fused`'s
    runs one before the kernel and the recompute another. q [b, s, g, r, hd]."""
    return _attended_fwd(piece, q, k, v)[0]


def _attended_fwd(piece, q, k, v):
    out, lse = (checkpoint_name(x, ATTENDED) for x in piece.forward(q, k, v))
    return out, (q, k, v, out, lse)


def _attended_bwd(piece, residuals, d_out):
    q, k, v, out, lse = residuals
    return piece.grads(q, k, v, (out, lse), d_out)


_attended.defvjp(_attended_fwd, _attended_bwd)


def kernel_for(model: ModelConfig, kv_len: int, platform: str) -> str:
    """The kernel `model.attention` runs for sequences of `kv_len` keys on `platform`:
    `auto` resolved as `attend` resolves it (without document masks, which the layout
    does not know)."""
    if model.attention != "auto":
        return model.attention
    per_layer = bool(model.sliding_window_pattern and model.sliding_window)
    return choose(platform, model.dtype, kv_len, model.head_dim,
                  model.attn_softcap is not None or per_layer)


def for_platform(model: ModelConfig, platform: str, documents: bool = False) -> ModelConfig:
    """`model` with `auto` resolved where the platform decides it at every length: cuDNN
    on NVIDIA GPUs where the model's shape allows it and rows carry no document masks
    (`choose`). An engine for a GPU target then traces the run's own kernel even when
    this process's backend is a CPU (`framework.compile`), where `attend` would resolve
    `auto` for the CPU. Elsewhere `auto` stays: each call picks by its length."""
    if model.attention != "auto" or documents or not _gpu_platform(platform):
        return model
    if kernel_for(model, DENSE_MAX_SEQ + 1, platform) != "cudnn":
        return model
    return dataclasses.replace(model, attention="cudnn")

