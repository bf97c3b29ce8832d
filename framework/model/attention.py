"""Causal grouped-query attention kernels, as plain functions of (q, k, v, block sizes,
position offsets). The model (`framework/model/llama.py`) calls `attend` with its
`ModelConfig` (the kernel, `model.attention`, and its block sizes); nothing here knows
about meshes, so under tensor parallelism each device simply runs its own heads.

Shapes (grouped-query attention, Ainslie et al. 2023: the r query heads of a group share
one key/value head, which is never repeated):

    q: [batch, q_len, kv_heads, r, head_dim]     k, v: [batch, kv_len, kv_heads, head_dim]
    out: like q

Positions: query i sits at q_offset + i, key j at kv_offset + j, and a query attends
the keys at or before its position (causal). Training uses 0 and 0; a decode step with
a cache passes the cache position as q_offset. Offsets may be Python ints or traced int32
scalars. Scores are scaled by 1/sqrt(head_dim) (Vaswani et al. 2017).

    dense      the reference: all [q_len, kv_len] scores at once, softmax in float32.
    blockwise  online softmax over key blocks (Milakov & Gimelshein 2018; Rabe & Staats
               2021; FlashAttention, Dao et al. 2022): per query block, running max m,
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

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from framework.config import CHOICES, ModelConfig, not_one_of
from framework.errors import ConfigError

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
    if model.attention == "cudnn" and model.n_heads and model.d_model % model.n_heads == 0 \
            and (model.head_dim % 8 or model.head_dim > 128):
        errs.append(f"model.attention=cudnn needs d_model/n_heads={model.head_dim} to be a "
                    f"multiple of 8 and at most 128: use model.attention=auto or blockwise")
    return errs


def choose(platform: str, dtype, kv_len: int, head_dim: int) -> str:
    """What `auto` runs: cudnn on NVIDIA GPUs when supported, else dense for short
    sequences and blockwise (linear memory) for long ones."""
    if _gpu_platform(platform) and cudnn_unsupported(dtype, head_dim) is None:
        return "cudnn"
    return "dense" if kv_len <= DENSE_MAX_SEQ else "blockwise"


def attend(q, k, v, model: ModelConfig, *, q_offset=0, kv_offset=0,
           platform: str | None = None):
    """Causal attention by `model.attention` (one of IMPLEMENTATIONS), blockwise with
    `model.attention_block_q` queries and `model.attention_block_kv` keys per block.
    `platform` resolves `auto` (default: JAX's default backend)."""
    implementation = model.attention
    if implementation == "auto":
        implementation = choose(platform or jax.default_backend(), q.dtype, k.shape[1],
                                q.shape[-1])
    if implementation == "dense":
        return dense_attention(q, k, v, q_offset=q_offset, kv_offset=kv_offset)
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, block_q=model.attention_block_q,
                                   block_kv=model.attention_block_kv, q_offset=q_offset,
                                   kv_offset=kv_offset)
    if implementation == "cudnn":
        return cudnn_attention(q, k, v, q_offset=q_offset, kv_offset=kv_offset)
    raise ValueError(f"attention implementation {implementation!r} is not one of "
                     f"{', '.join(IMPLEMENTATIONS)}")


def _causal_mask(q_len: int, kv_len: int, q_offset, kv_offset):
    """[q_len, kv_len] bool: key position <= query position."""
    q_pos = q_offset + jnp.arange(q_len, dtype=jnp.int32)
    kv_pos = kv_offset + jnp.arange(kv_len, dtype=jnp.int32)
    return kv_pos[None, :] <= q_pos[:, None]


# ---------------------------------------------------------------------------------
# dense: the reference.


def dense_attention(q, k, v, *, q_offset=0, kv_offset=0):
    """All scores at once: [batch, kv_heads, r, q_len, kv_len] float32, masked with the
    smallest finite float (a query with no visible key averages every value)."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    scores = jnp.einsum("bsgrk,btgk->bgrst", q, k).astype(jnp.float32) * scale
    mask = _causal_mask(q.shape[1], k.shape[1], q_offset, kv_offset)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bgrst,btgk->bsgrk", probs, v)


# ---------------------------------------------------------------------------------
# cudnn: NVIDIA's fused kernel.


def cudnn_attention(q, k, v, *, q_offset=0, kv_offset=0, implementation: str = "cudnn"):
    """cuDNN flash attention. GQA is native (query heads [kv_heads * r] in group-major
    order, keys and values with kv_heads heads). With equal static offsets and lengths
    (training) the causal mask is cuDNN's own, which skips the masked blocks; other
    offsets pass the mask explicitly. `implementation="xla"` runs the same call with
    XLA's kernel (how the tests check this wrapper on CPU)."""
    b, s, g, r, hd = q.shape
    flat = q.reshape(b, s, g * r, hd)  # head g*r + j: query j of group g, as JAX's GQA expects
    aligned = (isinstance(q_offset, int) and isinstance(kv_offset, int)
               and q_offset == kv_offset and s == k.shape[1])
    mask = None if aligned else _causal_mask(s, k.shape[1], q_offset, kv_offset)[None, None]
    return _fused(implementation, aligned, flat, k, v, mask).reshape(b, s, g, r, hd)


def _fused_call(implementation, is_causal, q, k, v, mask):
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal,
                                       implementation=implementation)
    return out + _zeros((), q, k, v).astype(out.dtype)  # typed like q, k, v in a shard_map


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(implementation, is_causal, q, k, v, mask):
    """The fused kernel behind a VJP of our own: its residuals are q, k, v (typed like
    the inputs inside a shard_map) and its backward differentiates the fused call
    again (cuDNN's backward kernel, after one more forward). The pipeline executors
    trace `jax.vjp` of a stage inside an outer differentiation and stash the
    residuals of a stage by type, which cuDNN's own residuals do not survive."""
    return _fused_call(implementation, is_causal, q, k, v, mask)


def _fused_fwd(implementation, is_causal, q, k, v, mask):
    return _fused_call(implementation, is_causal, q, k, v, mask), (q, k, v, mask)


def _fused_bwd(implementation, is_causal, residuals, d_out):
    q, k, v, mask = residuals
    call = lambda q, k, v: _fused_call(implementation, is_causal, q, k, v, mask)
    return (*jax.vjp(call, q, k, v)[1](d_out), None)


_fused.defvjp(_fused_fwd, _fused_bwd)


# ---------------------------------------------------------------------------------
# blockwise: online softmax with a recomputing backward.


def blockwise_attention(q, k, v, *, block_q: int = 512, block_kv: int = 512, q_offset=0,
                        kv_offset=0):
    """Flash-style attention in plain JAX (see the module docstring). Memory: the
    inputs, the output, a float32 log-sum-exp per query and one [block_q, block_kv]
    score block per (batch, head); never [q_len, kv_len]."""
    q_len, kv_len = q.shape[1], k.shape[1]
    bq, bk = min(block_q, q_len), min(block_kv, kv_len)
    if bq < 1 or bk < 1:
        raise ValueError(f"attention block sizes must be >= 1, got {block_q}, {block_kv}")
    pad = lambda x, n: jnp.pad(x, [(0, 0), (0, -x.shape[1] % n)] + [(0, 0)] * (x.ndim - 2))
    # typed like q, k, v inside a shard_map: the offsets are residuals of the VJP, and a
    # pipeline executor stashes residuals by type (constants would stand apart)
    typed = _zeros((), q, k, v).astype(jnp.int32)
    offsets = jnp.asarray(q_offset, jnp.int32) + typed, jnp.asarray(kv_offset, jnp.int32) + typed
    out = _flash(bq, bk, kv_len, pad(q, bq), pad(k, bk), pad(v, bk), *offsets)
    return out[:, :q_len]


def _blocks(x, n):  # [b, s, ...] -> [s / n, b, n, ...]
    return jnp.moveaxis(x.reshape((x.shape[0], x.shape[1] // n, n) + x.shape[2:]), 1, 0)


def _unblocks(x):  # inverse of _blocks
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _zeros(shape, *like):
    """float32 zeros carrying the varying mesh axes of `like` (inside a shard_map a loop
    carry must be typed like the values added to it)."""
    anchor = sum(jnp.zeros_like(x, shape=(), dtype=jnp.float32) for x in like)
    return jnp.broadcast_to(anchor, shape)


@dataclass(frozen=True)
class _Tiling:
    """How the padded queries and keys are cut into blocks and where they sit: bq queries
    and bk keys per block, kv_len real keys (those after it are padding), and the
    positions of the first query and the first key (int32 scalars, maybe traced)."""

    bq: int
    bk: int
    kv_len: int
    q_offset: jax.Array
    kv_offset: jax.Array


def _block_scores(q_blk, k_blk, i, j, tiling: _Tiling):
    """Scaled scores of query block i against key block j, masked entries -inf.
    q_blk: [b, bq, g, r, hd], k_blk: [b, bk, g, hd] -> [b, bq, g, r, bk] float32."""
    bq, bk = tiling.bq, tiling.bk
    scale = 1.0 / np.sqrt(q_blk.shape[-1])
    s = jnp.einsum("bqgrd,bkgd->bqgrk", q_blk, k_blk,
                   preferred_element_type=jnp.float32) * scale
    key = j * bk + jnp.arange(bk, dtype=jnp.int32)  # index into the (padded) keys
    q_pos = tiling.q_offset + i * bq + jnp.arange(bq, dtype=jnp.int32)
    visible = (tiling.kv_offset + key[None, :] <= q_pos[:, None]) & (key < tiling.kv_len)[None, :]
    return jnp.where(visible[None, :, None, None, :], s, -jnp.inf)


def _kv_blocks_needed(i, bq, bk, nk, q_offset, kv_offset):
    """Key blocks query block i can see: [0, hi), those starting at or before its last
    query (blocks above the causal diagonal are skipped)."""
    last_query = q_offset + (i + 1) * bq - 1
    return jnp.clip((last_query - kv_offset) // bk + 1, 0, nk)


def _first_q_block(j, bq, bk, nq, q_offset, kv_offset):
    """The first query block that sees key block j (the backward's lower bound)."""
    return jnp.clip((kv_offset + j * bk - q_offset) // bq, 0, nq)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(bq, bk, kv_len, q, k, v, q_offset, kv_offset):
    return _flash_forward(bq, bk, kv_len, q, k, v, q_offset, kv_offset)[0]


def _flash_forward(bq, bk, kv_len, q, k, v, q_offset, kv_offset):
    """(out [b, sq, g, r, hd], log-sum-exp [nq, b, bq, g, r] float32). Per query block,
    a loop over the key blocks it can see with the online-softmax update
        m' = max(m, rowmax(s)),  l' = e^(m - m') l + rowsum(e^(s - m')),
        acc' = e^(m - m') acc + e^(s - m') v."""
    nk = k.shape[1] // bk
    kb, vb = _blocks(k, bk), _blocks(v, bk)
    tiling = _Tiling(bq, bk, kv_len, q_offset, kv_offset)

    def query_block(args):
        i, q_blk = args  # q_blk: [b, bq, g, r, hd]
        stats = q_blk.shape[:-1]  # [b, bq, g, r]

        def key_block(j, carry):
            m, l, acc = carry
            s = _block_scores(q_blk, kb[j], i, j, tiling)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            acc = alpha[..., None] * acc + jnp.einsum(
                "bqgrk,bkgd->bqgrd", p.astype(v.dtype), vb[j], preferred_element_type=jnp.float32)
            return m_new, alpha * l + jnp.sum(p, axis=-1), acc

        init = (_zeros(stats, q_blk, k, v) - jnp.inf, _zeros(stats, q_blk, k, v),
                _zeros(q_blk.shape, q_blk, k, v))
        hi = _kv_blocks_needed(i, bq, bk, nk, q_offset, kv_offset)
        m, l, acc = jax.lax.fori_loop(0, hi, key_block, init)
        out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)
        return out.astype(q.dtype), lse

    qb = _blocks(q, bq)
    out, lse = jax.lax.map(query_block, (jnp.arange(qb.shape[0], dtype=jnp.int32), qb))
    return _unblocks(out), lse


def _flash_fwd(bq, bk, kv_len, q, k, v, q_offset, kv_offset):
    out, lse = _flash_forward(bq, bk, kv_len, q, k, v, q_offset, kv_offset)
    return out, (q, k, v, out, lse, q_offset, kv_offset)


def _flash_bwd(bq, bk, kv_len, residuals, d_out):
    """FlashAttention-2's backward, outer loop over key blocks: for key block j and each
    query block i that sees it, p = e^(s - lse) (recomputed), dv_j += p^T do,
    ds = p * (do v_j^T - D) with D = rowsum(do * out), dk_j += ds^T q, dq_i += ds k_j."""
    q, k, v, out, lse, q_offset, kv_offset = residuals
    scale = 1.0 / np.sqrt(q.shape[-1])
    nq, nk = q.shape[1] // bq, k.shape[1] // bk
    qb, dob = _blocks(q, bq), _blocks(d_out, bq)
    delta = _blocks(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), bq)
    tiling = _Tiling(bq, bk, kv_len, q_offset, kv_offset)

    def key_block(dq, args):
        j, k_blk, v_blk = args

        def query_block(i, carry):
            dq, dk, dv = carry
            q_blk, do_blk = qb[i], dob[i]
            s = _block_scores(q_blk, k_blk, i, j, tiling)
            p = jnp.exp(s - lse[i][..., None])  # [b, bq, g, r, bk]; masked entries 0
            dv = dv + jnp.einsum("bqgrk,bqgrd->bkgd", p.astype(v.dtype), do_blk,
                                 preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqgrd,bkgd->bqgrk", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta[i][..., None]) * scale).astype(q.dtype)
            dk = dk + jnp.einsum("bqgrk,bqgrd->bkgd", ds, q_blk, preferred_element_type=jnp.float32)
            dq_i = jnp.einsum("bqgrk,bkgd->bqgrd", ds, k_blk, preferred_element_type=jnp.float32)
            return dq.at[i].add(dq_i), dk, dv

        lo = _first_q_block(j, bq, bk, nq, q_offset, kv_offset)
        zero_kv = _zeros(k_blk.shape, q, k, v, d_out)
        dq, dk, dv = jax.lax.fori_loop(lo, nq, query_block, (dq, zero_kv, zero_kv))
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq0 = _zeros(qb.shape, q, k, v, d_out)  # [nq, b, bq, g, r, hd] float32
    dq, (dk, dv) = jax.lax.scan(
        key_block, dq0, (jnp.arange(nk, dtype=jnp.int32), _blocks(k, bk), _blocks(v, bk)))
    return _unblocks(dq).astype(q.dtype), _unblocks(dk), _unblocks(dv), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# Pieces for ring attention (framework/parallel/context.py), which merges the partial
# attentions of the key chunks it is passed and takes their gradients itself.

def flash_piece(q, k, v, bq: int, bk: int, q_offset, kv_offset):
    """The blockwise forward on lengths that bq and bk tile: (out like q, log-sum-exp
    [b, sq, g, r] float32, -inf where a query sees no key)."""
    offsets = jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32)
    out, lse = _flash_forward(bq, bk, k.shape[1], q, k, v, *offsets)
    lse = _unblocks(lse)
    return out, jnp.where(jnp.isinf(lse), -jnp.inf, lse)


def flash_piece_grads(q, k, v, out, lse, d_out, bq: int, bk: int, q_offset, kv_offset):
    """(dq, dk, dv) of this piece, from the *whole* attention's output and log-sum-exp
    of the queries (FlashAttention-2's backward restricted to these keys)."""
    offsets = jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32)
    residuals = (q, k, v, out, _blocks(lse, bq), *offsets)
    return _flash_bwd(bq, bk, k.shape[1], residuals, d_out)[:3]
