"""Blockwise attention in plain JAX, the kernel `model.attention=blockwise` runs
(framework/model/attention.py dispatches): online softmax over key blocks (Milakov &
Gimelshein 2018; Rabe & Staats 2021; FlashAttention, Dao et al. 2022) with a
recomputing backward (FlashAttention-2, Dao 2023), and the same pieces for ring
attention (framework/model/ring_attention.py). Shapes as in attention.py. What a call
takes besides q, k, v, in three small settings defined here (attention.py's kernels take
the first two as well):

    Mask       which keys a query sees: the positions of the first query and key, the
               document ids (`segments`), the sliding `window`; traced or not (a pytree)
    ScoreForm  how a score is made of q.k: scale and soft-cap (static)
    Blocks     queries and keys per block (static)

Key blocks wholly outside the window are never visited, and the soft-cap's derivative,
1 - tanh^2, enters the backward's ds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from framework.model.documents import visible

# An attention kernel's output and log-sum-exp, the residuals of its backward, by name
# (the blockwise, fused and ring kernels' custom VJPs): `save_dots` keeps them, so the
# backward runs no forward of the attention again (framework/model/stack.py).
ATTENDED = "attention_attended"


@dataclass(frozen=True)
class ScoreForm:
    """How a score is made of q.k (static): s = scale q.k, then with `softcap` c,
    s = c tanh(s / c) (Gemma 2's attention logit soft-capping, transformers'
    modeling_gemma2.py). scale None: 1/sqrt(head_dim) (Vaswani et al. 2017)."""

    scale: float | None = None
    softcap: float | None = None

    def of(self, head_dim: int) -> float:
        return 1.0 / np.sqrt(head_dim) if self.scale is None else self.scale


PLAIN = ScoreForm()


class Mask(NamedTuple):
    """Which keys a query sees: query i sits at position q_offset + i and key j at
    kv_offset + j, and a query sees the keys at or before its position (causal); with
    `segments` = (seg_q [b, q_len], seg_k [b, kv_len]) int32 document ids, only those of
    its own document; with `window` w, only those fewer than w positions before it.
    Offsets and window: Python ints or traced int32 scalars; segments or window None:
    none. A pytree: its arrays are arguments of the kernels' VJPs."""

    q_offset: Any = 0
    kv_offset: Any = 0
    segments: tuple | None = None
    window: Any = None


@dataclass(frozen=True)
class Blocks:
    """The blockwise kernel's tiles (static): `q` queries and `kv` keys per block
    (model.attention_block_q, model.attention_block_kv; cut to a shorter sequence)."""

    q: int = 512
    kv: int = 512


def blockwise_attention(q, k, v, *, mask: Mask = Mask(), form: ScoreForm = PLAIN,
                        blocks: Blocks = Blocks()):
    """Flash-style attention in plain JAX (see the module docstring). Memory: the
    inputs, the output, a float32 log-sum-exp per query and one [blocks.q, blocks.kv]
    score block per (batch, head); never [q_len, kv_len]."""
    q_len, kv_len = q.shape[1], k.shape[1]
    bq, bk = min(blocks.q, q_len), min(blocks.kv, kv_len)
    if bq < 1 or bk < 1:
        raise ValueError(f"attention block sizes must be >= 1, got {blocks.q}, {blocks.kv}")
    pad = lambda x, n: jnp.pad(x, [(0, 0), (0, -x.shape[1] % n)] + [(0, 0)] * (x.ndim - 2))
    # typed like q, k, v inside a shard_map: the offsets are residuals of the VJP, and a
    # pipeline executor stashes residuals by type (constants would stand apart)
    typed = zeros_varying_like((), q, k, v).astype(jnp.int32)
    offsets = (jnp.asarray(mask.q_offset, jnp.int32) + typed,
               jnp.asarray(mask.kv_offset, jnp.int32) + typed)
    window = None if mask.window is None else jnp.asarray(mask.window, jnp.int32) + typed
    padded = pad(q, bq), pad(k, bk), pad(v, bk)  # [b, s rounded up to whole blocks, ...]
    typed_mask = Mask(*offsets, _padded_segments(mask.segments, bq, bk), window)
    return _flash(_Kernel(bq, bk, kv_len, form), *padded, typed_mask)[:, :q_len]


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
class _Kernel:
    """The static settings of one kernel call: bq queries and bk keys per block (they
    tile the padded lengths), kv_len real keys (those after it are padding), the score
    form."""

    bq: int
    bk: int
    kv_len: int
    form: ScoreForm = PLAIN


@dataclass(frozen=True)
class _Tiling:
    """How the padded queries and keys are cut into blocks and where they sit: bq queries
    and bk keys per block, kv_len real keys (those after it are padding), and the
    positions of the first query and the first key (int32 scalars, maybe traced), the
    sliding window (None: none) and the score form."""

    bq: int
    bk: int
    kv_len: int
    q_offset: jax.Array
    kv_offset: jax.Array
    segments: tuple | None = None  # document ids, blocked: ([nq, b, bq], [nk, b, bk])
    window: jax.Array | None = None
    form: ScoreForm = PLAIN

    @staticmethod
    def of(kernel: _Kernel, mask: Mask) -> "_Tiling":
        """`kernel`'s tiling of the positions and documents of `mask` (offsets int32)."""
        segments = mask.segments
        blocked = None if segments is None else (
            _blocks(segments[0], kernel.bq), _blocks(segments[1], kernel.bk))
        return _Tiling(kernel.bq, kernel.bk, kernel.kv_len, mask.q_offset, mask.kv_offset,
                       blocked, mask.window, kernel.form)

    def kv_blocks(self, i, nk):
        """Key blocks query block i can see: [lo, hi), from the first within the window of
        its first query to the last starting at or before its last query (blocks above
        the causal diagonal or wholly outside the window are skipped)."""
        first_query = self.q_offset + i * self.bq
        hi = jnp.clip((first_query + self.bq - 1 - self.kv_offset) // self.bk + 1, 0, nk)
        if self.window is None:
            return 0, hi
        return jnp.clip((first_query - self.window + 1 - self.kv_offset) // self.bk, 0, hi), hi

    def q_blocks(self, j, nq):
        """Query blocks that see key block j: [lo, hi) (the backward's bounds)."""
        first_key = self.kv_offset + j * self.bk
        lo = jnp.clip((first_key - self.q_offset) // self.bq, 0, nq)
        if self.window is None:
            return lo, nq
        last_query = first_key + self.bk - 1 + self.window - 1  # the last that sees a key
        return lo, jnp.clip((last_query - self.q_offset) // self.bq + 1, lo, nq)


def _block_scores(q_blk, k_blk, i, j, tiling: _Tiling):
    """Scores of query block i against key block j in `tiling.form`, masked entries
    -inf, and the soft-cap's tanh (None without one), for the backward.
    q_blk: [b, bq, g, r, hd], k_blk: [b, bk, g, hd] -> [b, bq, g, r, bk] float32."""
    bq, bk, cap = tiling.bq, tiling.bk, tiling.form.softcap
    s = jnp.einsum("bqgrd,bkgd->bqgrk", q_blk, k_blk,
                   preferred_element_type=jnp.float32) * tiling.form.of(q_blk.shape[-1])
    tanh = None if cap is None else jnp.tanh(s / cap)
    s = s if cap is None else cap * tanh
    key = j * bk + jnp.arange(bk, dtype=jnp.int32)  # index into the (padded) keys
    q_pos = tiling.q_offset + i * bq + jnp.arange(bq, dtype=jnp.int32)
    seen = (tiling.kv_offset + key[None, :] <= q_pos[:, None]) & (key < tiling.kv_len)[None, :]
    if tiling.window is not None:  # and fewer than `window` positions before the query
        seen = seen & (q_pos[:, None] - tiling.kv_offset - key[None, :] < tiling.window)
    if tiling.segments is not None:  # [b, bq, bk]: and in the query's document
        seen = seen[None] & visible(tiling.segments[0][i], tiling.segments[1][j])
    seen = seen[:, :, None, None, :] if seen.ndim == 3 else seen[None, :, None, None, :]
    return jnp.where(seen, s, -jnp.inf), tanh


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(kernel: _Kernel, q, k, v, mask: Mask):
    """q: [b, sq, g, r, hd], k, v: [b, sk, g, hd] with sq, sk whole blocks of `kernel`;
    `mask`'s offsets (and window) int32 arrays. -> like q."""
    return _flash_forward(kernel, q, k, v, mask)[0]


def _flash_forward(kernel: _Kernel, q, k, v, mask: Mask):
    """(out [b, sq, g, r, hd], log-sum-exp [nq, b, bq, g, r] float32). Per query block,
    a loop over the key blocks it can see with the online-softmax update
        m' = max(m, rowmax(s)),  l' = e^(m - m') l + rowsum(e^(s - m')),
        acc' = e^(m - m') acc + e^(s - m') v."""
    bq, bk = kernel.bq, kernel.bk
    nk = k.shape[1] // bk
    kb, vb = _blocks(k, bk), _blocks(v, bk)
    tiling = _Tiling.of(kernel, mask)

    def query_block(args):
        i, q_blk = args  # q_blk: [b, bq, g, r, hd]
        stats = q_blk.shape[:-1]  # [b, bq, g, r]

        def key_block(j, carry):
            m, l, acc = carry
            s = _block_scores(q_blk, kb[j], i, j, tiling)[0]
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            acc = alpha[..., None] * acc + jnp.einsum(
                "bqgrk,bkgd->bqgrd", p.astype(v.dtype), vb[j], preferred_element_type=jnp.float32)
            return m_new, alpha * l + jnp.sum(p, axis=-1), acc

        init = (zeros_varying_like(stats, q_blk, k, v) - jnp.inf, zeros_varying_like(stats, q_blk, k, v),
                zeros_varying_like(q_blk.shape, q_blk, k, v))
        m, l, acc = jax.lax.fori_loop(*tiling.kv_blocks(i, nk), key_block, init)
        out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)
        return out.astype(q.dtype), lse

    qb = _blocks(q, bq)
    out, lse = jax.lax.map(query_block, (jnp.arange(qb.shape[0], dtype=jnp.int32), qb))
    return _unblocks(out), lse


def _flash_fwd(kernel: _Kernel, q, k, v, mask: Mask):
    out, lse = (checkpoint_name(x, ATTENDED) for x in _flash_forward(kernel, q, k, v, mask))
    return out, (q, k, v, out, lse, mask)


def _flash_bwd(kernel: _Kernel, residuals, d_out):
    """FlashAttention-2's backward, outer loop over key blocks: for key block j and each
    query block i that sees it, p = e^(s - lse) (recomputed), dv_j += p^T do,
    ds = p * (do v_j^T - D) with D = rowsum(do * out), dk_j += ds^T q, dq_i += ds k_j;
    with a soft-cap, ds *= 1 - tanh^2 (d/dx c tanh(x / c))."""
    q, k, v, out, lse, mask = residuals
    bq, bk = kernel.bq, kernel.bk
    scale = kernel.form.of(q.shape[-1])
    nq, nk = q.shape[1] // bq, k.shape[1] // bk
    qb, dob = _blocks(q, bq), _blocks(d_out, bq)
    delta = _blocks(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), bq)
    tiling = _Tiling.of(kernel, mask)

    def key_block(dq, args):
        j, k_blk, v_blk = args

        def query_block(i, carry):
            dq, dk, dv = carry
            q_blk, do_blk = qb[i], dob[i]
            s, tanh = _block_scores(q_blk, k_blk, i, j, tiling)
            p = jnp.exp(s - lse[i][..., None])  # [b, bq, g, r, bk]; masked entries 0
            dv = dv + jnp.einsum("bqgrk,bqgrd->bkgd", p.astype(v.dtype), do_blk,
                                 preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqgrd,bkgd->bqgrk", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[i][..., None]) * scale
            ds = (ds if tanh is None else ds * (1.0 - tanh * tanh)).astype(q.dtype)
            dk = dk + jnp.einsum("bqgrk,bqgrd->bkgd", ds, q_blk, preferred_element_type=jnp.float32)
            dq_i = jnp.einsum("bqgrk,bkgd->bqgrd", ds, k_blk, preferred_element_type=jnp.float32)
            return dq.at[i].add(dq_i), dk, dv

        zero_kv = zeros_varying_like(k_blk.shape, q, k, v, d_out)
        dq, dk, dv = jax.lax.fori_loop(*tiling.q_blocks(j, nq), query_block,
                                       (dq, zero_kv, zero_kv))
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq0 = zeros_varying_like(qb.shape, q, k, v, d_out)  # [nq, b, bq, g, r, hd] float32
    dq, (dk, dv) = jax.lax.scan(
        key_block, dq0, (jnp.arange(nk, dtype=jnp.int32), _blocks(k, bk), _blocks(v, bk)))
    no_grad = jax.tree.map(lambda _: None, mask)  # integer positions and ids: no cotangent
    return _unblocks(dq).astype(q.dtype), _unblocks(dk), _unblocks(dv), no_grad


_flash.defvjp(_flash_fwd, _flash_bwd)


# Pieces for ring attention (framework/parallel/context.py), which merges the partial
# attentions of the key chunks it is passed and takes their gradients itself.

def _int32_offsets(mask: Mask) -> Mask:
    """`mask` with its offsets as int32 arrays, as the kernel computes positions."""
    return mask._replace(q_offset=jnp.asarray(mask.q_offset, jnp.int32),
                         kv_offset=jnp.asarray(mask.kv_offset, jnp.int32))


def flash_piece(q, k, v, blocks: Blocks, mask: Mask, form: ScoreForm = PLAIN):
    """The blockwise forward on lengths that `blocks` tile: (out like q, log-sum-exp
    [b, sq, g, r] float32, -inf where a query sees no key)."""
    out, lse = _flash_forward(_Kernel(blocks.q, blocks.kv, k.shape[1], form), q, k, v,
                              _int32_offsets(mask))
    lse = _unblocks(lse)
    return out, jnp.where(jnp.isinf(lse), -jnp.inf, lse)


def flash_piece_grads(q, k, v, whole, d_out, blocks: Blocks, mask: Mask,
                      form: ScoreForm = PLAIN):
    """(dq, dk, dv) of this piece, from `whole` = (out like q, log-sum-exp [b, sq, g, r]):
    the *whole* attention's of these queries, flash_piece's pair merged over every
    piece (FlashAttention-2's backward restricted to these keys)."""
    out, lse = whole
    mask = _int32_offsets(mask)
    residuals = (q, k, v, out, _blocks(lse, blocks.q), mask)
    return _flash_bwd(_Kernel(blocks.q, blocks.kv, k.shape[1], form), residuals, d_out)[:3]
