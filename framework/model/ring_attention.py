"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"):
causal attention of this device's queries over a sequence split over several devices,
each holding two mirrored chunks of it (framework/parallel/context.py). The model
calls `ring_attention` with the `ContextParallel` object it is handed (through its
tensor-parallel plan); nothing here knows the mesh: that object says which chunks this
device holds, whose keys it holds at each step (`holder`) and passes them on (`shift`).

Each device keeps its queries and passes its keys and values around the ring: at step
j it holds those of device s = i - j (mod c) and adds their contribution to its
queries' output with FlashAttention's online-softmax merge (Dao et al. 2022: outputs
normalised over their own keys, combined by their log-sum-exps), while they travel on
to device i + 1. Per step each (query chunk, key chunk) pair runs one piece: the
blockwise kernel of framework/model/blockwise.py (`flash_piece`) at its own positions,
where a pair wholly above the causal diagonal visits no key block; or, for
`model.attention=cudnn` without document masks, windows or soft-caps, cuDNN's fused
kernel (framework/model/fused_pieces.py), which runs only the pairs that see keys. Each
device computes two chunk-pairs a step either way. The backward is a ring too (a
custom VJP: memory linear in the sequence, only q, k, v, the output and the
log-sum-exp kept): the keys and values go around again with their float32 gradients
accumulating beside them, and after c shifts each device holds the gradients of its
own.

Shapes: q [b, 2h, g, r, hd], k, v [b, 2h, g, hd] (h: a chunk's tokens; g kv heads of
r queries each, as in attention.py). Document masks: every device has the whole
sequence's segment ids [b, 2ch] (framework/model/documents.py, a few bytes a token) and
cuts each pair's out by chunk, so nothing more travels round the ring. A sliding
window and the score form (framework/model/attention.py) go to every pair at the
pair's global positions; a pair wholly outside the window visits no key block.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from framework.model.blockwise import (ATTENDED, PLAIN, Blocks, Mask, ScoreForm, flash_piece,
                                       flash_piece_grads)
from framework.model.fused_pieces import CAUSAL, CUDNN, FULL, FusedKernel, FusedPiece

SEQ = 1  # activations are [batch, seq, ...]
FUSED: FusedKernel = CUDNN  # the fused ring's kernel


def ring_attention(q, k, v, cfg, cp, segments=None, window=None, form=None):
    """Causal attention of this device's queries over the whole sequence: for
    `attention=cudnn` without `segments`, `window` or a soft-cap, the `FUSED` kernel
    per chunk pair (cuDNN's; the CPU tests put fused_pieces.REFERENCE there); else
    blockwise with `cfg.attention_block_q/kv` (block sizes that tile a chunk) or, for
    `attention=dense`, one block per chunk pair. `segments`: the whole sequence's
    document ids [b, n], or None; `window`: the sliding window (int or traced), or
    None; `form`: the scores' ScoreForm (None: plain)."""
    h, form = q.shape[SEQ] // 2, PLAIN if form is None else form
    if cfg.attention == "cudnn" and segments is None and window is None \
            and form.softcap is None:
        return _ring(cp, _Fused(FUSED, form.of(q.shape[-1])), q, k, v)
    blocks = Blocks(_divisor(h, cfg.attention_block_q), _divisor(h, cfg.attention_block_kv))
    if cfg.attention == "dense":
        blocks = Blocks(h, h)
    window = None if window is None else jnp.asarray(window, jnp.int32)
    return _ring(cp, _Flash(blocks, form), q, k, v, segments, window)


def _divisor(n: int, at_most: int) -> int:
    """The largest divisor of n that is at most `at_most` (a block size that tiles n)."""
    return max(d for d in range(1, min(n, max(at_most, 1)) + 1) if n % d == 0)


def _halves(x):
    h = x.shape[SEQ] // 2
    return x[:, :h], x[:, h:]


def _pair_mask(segments, window, qc, kc, h) -> Mask:
    """What the queries of chunk qc see of the keys of chunk kc (chunk c: positions c h
    .. c h + h - 1): their positions, their document ids (or None), the window."""
    if segments is None:
        return Mask(qc * h, kc * h, None, window)
    cut = lambda c: jax.lax.dynamic_slice_in_dim(segments, c * h, h, axis=SEQ)
    return Mask(qc * h, kc * h, (cut(qc), cut(kc)), window)


def _pairs(cp, step: int):
    """(query half, key half, query chunk, key chunk) of the four chunk pairs at ring
    step `step`, when this device holds the keys of device s = i - step (chunk c
    starts at position c h)."""
    c, h_pos = cp.size, cp.chunks()
    s = cp.holder(step)
    kv_pos = (s, 2 * c - 1 - s)
    return [(a, b, h_pos[a], kv_pos[b]) for a in (0, 1) for b in (0, 1)]


class _Flash(NamedTuple):
    """The blockwise pieces: each pair of a step at its own positions and documents."""

    blocks: Blocks
    form: ScoreForm

    def pairs(self, cp, step: int, segments, window, h: int):
        """(query half, key half, piece) of every chunk pair at ring step `step`."""
        return [(a, b, _FlashPiece(self, _pair_mask(segments, window, qc, kc, h)))
                for a, b, qc, kc in _pairs(cp, step)]


class _FlashPiece(NamedTuple):
    how: _Flash
    mask: Mask

    def forward(self, q, k, v):
        return flash_piece(q, k, v, self.how.blocks, self.mask, self.how.form)

    def grads(self, q, k, v, whole, d_out):
        return flash_piece_grads(q, k, v, whole, d_out, self.how.blocks, self.mask,
                                 self.how.form)


class _Fused(NamedTuple):
    """A fused kernel's pieces (framework/model/fused_pieces.py): at step 0 the device's
    own chunks, each causally, and its late chunk's queries over its early chunk's keys;
    at a later step, with the keys of device s, the late queries over the early keys
    (chunk 2c - 1 - i > s) and one more: its early queries over the early keys when
    s < i, else its late queries over the late keys (2c - 1 - s < 2c - 1 - i), which
    depends on the device (traced)."""

    kernel: FusedKernel
    scale: float

    def pairs(self, cp, step: int, segments, window, h: int):
        if step == 0:
            kinds = [(0, 0, CAUSAL), (1, 1, CAUSAL), (1, 0, FULL)]
        else:
            i, s = cp.chunks()[0], cp.holder(step)
            kinds = [(0, 0, s < i), (1, 1, s > i), (1, 0, FULL)]
        return [(a, b, FusedPiece(self.kernel, kind, self.scale)) for a, b, kind in kinds]


def _merge(out, lse, piece_out, piece_lse):
    """Online-softmax merge of two partial attentions over disjoint keys: outputs
    [b, n, g, r, hd] float32 normalised over their own keys, log-sum-exps [b, n, g, r]
    (-inf: no key visible)."""
    top = jnp.maximum(lse, piece_lse)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w, w_piece = jnp.exp(lse - top), jnp.exp(piece_lse - top)
    total = w + w_piece
    safe = jnp.where(total > 0, total, 1.0)
    out = (out * w[..., None] + piece_out * w_piece[..., None]) / safe[..., None]
    return out, jnp.where(total > 0, top + jnp.log(safe), -jnp.inf)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(cp, how, q, k, v, segments=None, window=None):
    return _ring_forward(cp, how, q, k, v, segments, window)[0]


def _ring_forward(cp, how, q, k, v, segments=None, window=None):
    """(out like q, log-sum-exp [b, 2h, g, r] float32). how: _Flash or _Fused."""
    h = q.shape[SEQ] // 2
    qs = _halves(q)
    outs = [jnp.zeros(x.shape, jnp.float32) for x in qs]  # [b, h, g, r, hd] per half
    lses = [jnp.full(x.shape[:-1], -jnp.inf, jnp.float32) for x in qs]  # [b, h, g, r]
    kv = (k, v)
    for step in range(cp.size):
        def attend_held(kv=kv, step=step, outs=tuple(outs), lses=tuple(lses)):
            outs, lses = list(outs), list(lses)
            ks, vs = _halves(kv[0]), _halves(kv[1])
            for a, b, piece in how.pairs(cp, step, segments, window, h):
                o, lse = piece.forward(qs[a], ks[b], vs[b])
                outs[a], lses[a] = _merge(outs[a], lses[a], o.astype(jnp.float32), lse)
            return outs, lses

        last = step == cp.size - 1  # the held keys travel on while this step runs
        kv, (outs, lses) = (None, attend_held()) if last else _beside(cp.shift(kv),
                                                                       attend_held)
    return (jnp.concatenate(outs, axis=SEQ).astype(q.dtype),
            jnp.concatenate(lses, axis=SEQ))


def _ring_fwd(cp, how, q, k, v, segments=None, window=None):
    out, lse = (checkpoint_name(x, ATTENDED)
                for x in _ring_forward(cp, how, q, k, v, segments, window))
    return out, (q, k, v, out, lse, segments, window)


def _ring_bwd(cp, how, residuals, d_out):
    """The keys and values go around the ring again, their gradients beside them: at
    step j device i holds device (i - j)'s keys and values and the sum of their
    gradients so far (passed on from device i - 1), and adds its queries' share; one
    more shift after the last step brings each device its own. Each step's shifts (the
    keys and values on, the last step's sum) travel while its blocks run."""
    q, k, v, out, lse, segments, window = residuals
    h = q.shape[SEQ] // 2
    qs, outs, lses, d_outs = _halves(q), _halves(out), _halves(lse), _halves(d_out)
    dq = [jnp.zeros(x.shape, jnp.float32) for x in qs]
    kv, summed = (k, v), None  # summed: the gradients of the keys/values held, so far

    def grads_of_held(kv, step, dq):
        """(dq with this step's share, (dk, dv) [b, 2h, g, hd] float32 of the held keys)."""
        dq, parts = list(dq), [[0.0, 0.0], [0.0, 0.0]]  # [dk, dv][key half]
        ks, vs = _halves(kv[0]), _halves(kv[1])
        for a, b, piece in how.pairs(cp, step, segments, window, h):
            dq_a, dk_b, dv_b = piece.grads(qs[a], ks[b], vs[b], (outs[a], lses[a]),
                                           d_outs[a])
            dq[a] = dq[a] + dq_a
            parts[0][b] = parts[0][b] + dk_b.astype(jnp.float32)
            parts[1][b] = parts[1][b] + dv_b.astype(jnp.float32)
        return dq, tuple(jnp.concatenate(p, axis=SEQ) for p in parts)

    for step in range(cp.size):
        # two shifts, not one: the keys' is the recomputed forward ring's too (remat),
        # and the compiler merges the two (the backward's bytes only once)
        sends = (cp.shift(kv) if step < cp.size - 1 else None,
                 None if summed is None else cp.shift(summed))
        (kv, arrived), (dq, mine) = _beside(
            sends, lambda kv=kv, step=step, dq=tuple(dq): grads_of_held(kv, step, dq))
        summed = mine if arrived is None else tuple(a + m for a, m in zip(arrived, mine))
    dk, dv = cp.shift(summed)
    return (jnp.concatenate(dq, axis=SEQ).astype(q.dtype), dk.astype(k.dtype),
            dv.astype(v.dtype), None, None)


def _beside(sent, compute):
    """(sent, compute()) with neither usable before both are done, so that the scheduler
    runs the step's blocks while the shift travels (without it the GPU compiler issued
    each shift and waited for it before the blocks; framework/parallel/tensor.py's
    rings met the same)."""
    return jax.lax.optimization_barrier((sent, compute()))


_ring.defvjp(_ring_fwd, _ring_bwd)
