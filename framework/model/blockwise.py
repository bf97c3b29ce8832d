"""Blockwise attention in plain JAX, the kernel `model.attention=blockwise` runs
(framework/model/attention.py dispatches): online softmax over key blocks (Milakov &
Gimelshein 2018; Rabe & Staats 2021; FlashAttention, Dao et al. 2022) with a
recomputing backward (FlashAttention-2, Dao 2023), and the same pieces for ring
attention (framework/model/ring_attention.py). Shapes and positions as in attention.py;
`segments` (document ids of the queries and the keys) as there.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from framework.model.documents import visible

def blockwise_attention(q, k, v, *, block_q: int = 512, block_kv: int = 512, q_offset=0,
                        kv_offset=0, segments=None):
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
    typed = zeros_varying_like((), q, k, v).astype(jnp.int32)
    offsets = jnp.asarray(q_offset, jnp.int32) + typed, jnp.asarray(kv_offset, jnp.int32) + typed
    out = _flash(bq, bk, kv_len, pad(q, bq), pad(k, bk), pad(v, bk), *offsets,
                 _padded_segments(segments, bq, bk))
    return out[:, :q_len]


def _padded_segments(segments, bq: int, bk: int):
    """(seg_q, seg_k) padded to whole blocks (padding keys are masked by kv_len), or None."""
    if segments is None:
        return None
    pad = lambda x, n: jnp.pad(x, [(0, 0), (0, -x.shape[1] % n)], constant_values=-1)
    return pad(segments[0], bq), pad(segments[1], bk)


def _blocks(x, n):  # [b, s, ...] -> [s / n, b, n, ...]
    return jnp.moveaxis(x.reshape((x.shape[0], x.shape[1] // n, n) + x.shape[2:]), 1, 0)


def _unblocks(x):  # inverse of _blocks
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def zeros_varying_like(shape, *like):
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
    segments: tuple | None = None  # document ids, blocked: ([nq, b, bq], [nk, b, bk])

    @staticmethod
    def of(bq, bk, kv_len, q_offset, kv_offset, segments) -> "_Tiling":
        blocked = None if segments is None else (
            _blocks(segments[0], bq), _blocks(segments[1], bk))
        return _Tiling(bq, bk, kv_len, q_offset, kv_offset, blocked)


def _block_scores(q_blk, k_blk, i, j, tiling: _Tiling):
    """Scaled scores of query block i against key block j, masked entries -inf.
    q_blk: [b, bq, g, r, hd], k_blk: [b, bk, g, hd] -> [b, bq, g, r, bk] float32."""
    bq, bk = tiling.bq, tiling.bk
    scale = 1.0 / np.sqrt(q_blk.shape[-1])
    s = jnp.einsum("bqgrd,bkgd->bqgrk", q_blk, k_blk,
                   preferred_element_type=jnp.float32) * scale
    key = j * bk + jnp.arange(bk, dtype=jnp.int32)  # index into the (padded) keys
    q_pos = tiling.q_offset + i * bq + jnp.arange(bq, dtype=jnp.int32)
    seen = (tiling.kv_offset + key[None, :] <= q_pos[:, None]) & (key < tiling.kv_len)[None, :]
    if tiling.segments is not None:  # [b, bq, bk]: and in the query's document
        seen = seen[None] & visible(tiling.segments[0][i], tiling.segments[1][j])
    seen = seen[:, :, None, None, :] if seen.ndim == 3 else seen[None, :, None, None, :]
    return jnp.where(seen, s, -jnp.inf)


def _kv_blocks_needed(i, bq, bk, nk, q_offset, kv_offset):
    """Key blocks query block i can see: [0, hi), those starting at or before its last
    query (blocks above the causal diagonal are skipped)."""
    last_query = q_offset + (i + 1) * bq - 1
    return jnp.clip((last_query - kv_offset) // bk + 1, 0, nk)


def _first_q_block(j, bq, bk, nq, q_offset, kv_offset):
    """The first query block that sees key block j (the backward's lower bound)."""
    return jnp.clip((kv_offset + j * bk - q_offset) // bq, 0, nq)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(bq, bk, kv_len, q, k, v, q_offset, kv_offset, segments=None):
    return _flash_forward(bq, bk, kv_len, q, k, v, q_offset, kv_offset, segments)[0]


def _flash_forward(bq, bk, kv_len, q, k, v, q_offset, kv_offset, segments=None):
    """(out [b, sq, g, r, hd], log-sum-exp [nq, b, bq, g, r] float32). Per query block,
    a loop over the key blocks it can see with the online-softmax update
        m' = max(m, rowmax(s)),  l' = e^(m - m') l + rowsum(e^(s - m')),
        acc' = e^(m - m') acc + e^(s - m') v."""
    nk = k.shape[1] // bk
    kb, vb = _blocks(k, bk), _blocks(v, bk)
    tiling = _Tiling.of(bq, bk, kv_len, q_offset, kv_offset, segments)

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

        init = (zeros_varying_like(stats, q_blk, k, v) - jnp.inf, zeros_varying_like(stats, q_blk, k, v),
                zeros_varying_like(q_blk.shape, q_blk, k, v))
        hi = _kv_blocks_needed(i, bq, bk, nk, q_offset, kv_offset)
        m, l, acc = jax.lax.fori_loop(0, hi, key_block, init)
        out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)
        return out.astype(q.dtype), lse

    qb = _blocks(q, bq)
    out, lse = jax.lax.map(query_block, (jnp.arange(qb.shape[0], dtype=jnp.int32), qb))
    return _unblocks(out), lse


def _flash_fwd(bq, bk, kv_len, q, k, v, q_offset, kv_offset, segments=None):
    out, lse = _flash_forward(bq, bk, kv_len, q, k, v, q_offset, kv_offset, segments)
    return out, (q, k, v, out, lse, q_offset, kv_offset, segments)


def _flash_bwd(bq, bk, kv_len, residuals, d_out):
    """FlashAttention-2's backward, outer loop over key blocks: for key block j and each
    query block i that sees it, p = e^(s - lse) (recomputed), dv_j += p^T do,
    ds = p * (do v_j^T - D) with D = rowsum(do * out), dk_j += ds^T q, dq_i += ds k_j."""
    q, k, v, out, lse, q_offset, kv_offset, segments = residuals
    scale = 1.0 / np.sqrt(q.shape[-1])
    nq, nk = q.shape[1] // bq, k.shape[1] // bk
    qb, dob = _blocks(q, bq), _blocks(d_out, bq)
    delta = _blocks(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), bq)
    tiling = _Tiling.of(bq, bk, kv_len, q_offset, kv_offset, segments)

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
        zero_kv = zeros_varying_like(k_blk.shape, q, k, v, d_out)
        dq, dk, dv = jax.lax.fori_loop(lo, nq, query_block, (dq, zero_kv, zero_kv))
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq0 = zeros_varying_like(qb.shape, q, k, v, d_out)  # [nq, b, bq, g, r, hd] float32
    dq, (dk, dv) = jax.lax.scan(
        key_block, dq0, (jnp.arange(nk, dtype=jnp.int32), _blocks(k, bk), _blocks(v, bk)))
    no_grad = jax.tree.map(lambda _: None, segments)  # integer ids: no cotangent
    return _unblocks(dq).astype(q.dtype), _unblocks(dk), _unblocks(dv), None, None, no_grad


_flash.defvjp(_flash_fwd, _flash_bwd)


# Pieces for ring attention (framework/parallel/context.py), which merges the partial
# attentions of the key chunks it is passed and takes their gradients itself.

def flash_piece(q, k, v, bq: int, bk: int, q_offset, kv_offset, segments=None):
    """The blockwise forward on lengths that bq and bk tile: (out like q, log-sum-exp
    [b, sq, g, r] float32, -inf where a query sees no key)."""
    offsets = jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32)
    out, lse = _flash_forward(bq, bk, k.shape[1], q, k, v, *offsets, segments)
    lse = _unblocks(lse)
    return out, jnp.where(jnp.isinf(lse), -jnp.inf, lse)


def flash_piece_grads(q, k, v, out, lse, d_out, bq: int, bk: int, q_offset, kv_offset,
                      segments=None):
    """(dq, dk, dv) of this piece, from the *whole* attention's output and log-sum-exp
    of the queries (FlashAttention-2's backward restricted to these keys)."""
    offsets = jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32)
    residuals = (q, k, v, out, _blocks(lse, bq), *offsets, segments)
    return _flash_bwd(bq, bk, k.shape[1], residuals, d_out)[:3]
