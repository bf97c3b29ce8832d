"""cuDNN's fused attention as ring attention's kernel per chunk pair (issue 43 item 1):
what framework/model/ring_attention.py runs for `model.attention=cudnn` (what `auto`
resolves to on NVIDIA GPUs) where no document mask, per-layer window or soft-cap asks
for the blockwise pieces.

A ring merges its pieces by their log-sum-exps and differentiates each piece with the
*whole* attention's output and log-sum-exp (FlashAttention-2's backward restricted to
a piece's keys, Dao 2023: dS = P (dO V^T - rowsum(dO O)), P = exp(S - lse)). JAX's
public `jax.nn.dot_product_attention` gives neither, so the two calls here are JAX's
cuDNN wrapper one level down (`jax._src.cudnn.fused_attention_stablehlo`, the module
`jax.nn.dot_product_attention` calls; the same signatures in jax 0.10.2 and 0.11):

    forward   `dot_product_attention(..., return_residual=True)`: (out, the
              log-sum-exp of the scaled scores [b, heads, q_len] float32)
    backward  the rule JAX's own VJP of that call runs (cuDNN's backward kernel), handed
              the whole attention's output and log-sum-exp in place of this piece's.

Beside it, `REFERENCE`: the same two functions in plain JAX with every score at once, a
naive reference that the ring's tests run on CPU devices, where cuDNN is not.

A ring's chunks are of equal length h, so a piece is one of three kinds: the diagonal
pair (CAUSAL: cuDNN's own causal mask, aligned), a pair wholly below the diagonal (FULL:
no mask) or one wholly above it (no key visible: not run). Where the kind depends on
the device (a traced bool: FULL when true, nothing when false) the piece runs under a
`lax.cond`. Shapes in this file's kernels: q [b, t, n, hd] (n = g r query heads,
group-major), k, v [b, s, g, hd] (BTNH, cuDNN's GQA); a piece takes and gives the
model's [b, t, g, r, hd].
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from framework.model.blockwise import zeros_varying_like

CAUSAL, FULL = "causal", "full"


class FusedKernel(NamedTuple):
    """A fused attention kernel's two calls (static; BTNH shapes, module docstring):
    forward(q, k, v, causal, scale) -> (out like q, lse [b, n, t] float32) and
    backward(q, k, v, out, lse, d_out, causal, scale) -> (dq, dk, dv), where out and
    lse are the whole attention's."""

    forward: Callable
    backward: Callable


def _cudnn():
    from jax._src.cudnn import fused_attention_stablehlo as fused
    return fused


def _mask_type(causal: bool):
    fused = _cudnn()
    return fused.MaskType.CAUSAL if causal else fused.MaskType.NO_MASK


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    return _cudnn().dot_product_attention(q, k, v, scale=scale, mask_type=_mask_type(causal),
                                          qkv_layout="BTNH", return_residual=True)


def _cudnn_backward(q, k, v, out, lse, d_out, causal: bool, scale: float):
    """cuDNN's backward kernel with the whole attention's `out` and `lse` as its
    residuals: JAX's VJP rule of the forward above, called with those (no bias,
    sequence lengths, offsets or pages: empty arrays, as the forward passes them)."""
    fused = _cudnn()
    unused = jnp.zeros(0, q.dtype)
    residuals = (q, k, v) + (unused,) * 7 + (lse, out)
    grads = fused._dot_product_attention_bwd_rule(
        scale, 42, 0.0, (False, False), _mask_type(causal), fused.AttentionLayout.BTNH.value,
        None, fused.check_cudnn_version(), False, residuals, d_out)
    return grads[:3]


CUDNN = FusedKernel(_cudnn_forward, _cudnn_backward)


def _scores(q, k, causal: bool, scale: float):
    """[b, g, r, t, s] float32 scaled scores (-inf above the diagonal if causal) and q
    as [b, t, g, r, hd]."""
    b, t, n, hd = q.shape
    grouped = q.reshape(b, t, k.shape[2], n // k.shape[2], hd)
    s = jnp.einsum("btgrk,bsgk->bgrts", grouped, k,
                   preferred_element_type=jnp.float32) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((t, k.shape[1]), bool)), s, -jnp.inf)
    return s, grouped


def _reference_forward(q, k, v, causal: bool, scale: float):
    b, t, n, hd = q.shape
    s, _ = _scores(q, k, causal, scale)
    lse = jax.nn.logsumexp(s, axis=-1)  # [b, g, r, t]
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bgrts,bsgk->btgrk", p, v.astype(jnp.float32))
    return out.reshape(b, t, n, hd).astype(q.dtype), lse.reshape(b, n, t)


def _reference_backward(q, k, v, out, lse, d_out, causal: bool, scale: float):
    """FlashAttention-2's backward (Dao 2023, Algorithm 2) with every score at once."""
    b, t, n, hd = q.shape
    s, grouped = _scores(q, k, causal, scale)
    p = jnp.exp(s - lse.reshape(s.shape[:-1])[..., None])  # [b, g, r, t, s]
    f32 = lambda x: x.reshape(grouped.shape).astype(jnp.float32)
    do, o = f32(d_out), f32(out)
    dv = jnp.einsum("bgrts,btgrk->bsgk", p, do)
    dp = jnp.einsum("btgrk,bsgk->bgrts", do, v.astype(jnp.float32))
    rows = jnp.einsum("btgrk,btgrk->bgrt", do, o)  # rowsum(dO O)
    ds = p * (dp - rows[..., None]) * scale
    dq = jnp.einsum("bgrts,bsgk->btgrk", ds, k.astype(jnp.float32))
    dk = jnp.einsum("bgrts,btgrk->bsgk", ds, grouped.astype(jnp.float32))
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


REFERENCE = FusedKernel(_reference_forward, _reference_backward)


class FusedPiece(NamedTuple):
    """One chunk pair of a ring through `kernel`: `kind` CAUSAL, FULL, or a traced bool
    (FULL where true, no key visible where false); `scale` the scores'."""

    kernel: FusedKernel
    kind: Any
    scale: float

    def _when_visible(self, run, nothing):
        if isinstance(self.kind, str):
            return run(self.kind == CAUSAL)
        return jax.lax.cond(self.kind, lambda: run(False), nothing)

    def forward(self, q, k, v):
        """(out like q, lse [b, t, g, r] float32; -inf where no key is visible)."""
        b, t, g, r, hd = q.shape
        typed = zeros_varying_like((), q, k, v)  # the outputs typed like the inputs

        def run(causal):
            out, lse = self.kernel.forward(q.reshape(b, t, g * r, hd), k, v, causal, self.scale)
            return (out.reshape(q.shape) + typed.astype(out.dtype),
                    jnp.swapaxes(lse, 1, 2).reshape(b, t, g, r) + typed)

        nothing = lambda: (jnp.zeros_like(q) + typed.astype(q.dtype),
                           jnp.full((b, t, g, r), -jnp.inf, jnp.float32) + typed)
        return self._when_visible(run, nothing)

    def grads(self, q, k, v, whole, d_out):
        """(dq, dk, dv) of this piece, from `whole` = (out like q, lse [b, t, g, r]): the
        whole attention's of these queries."""
        out, lse = whole
        b, t, g, r, hd = q.shape
        flat = lambda x: x.reshape(b, t, g * r, hd)
        stats = jnp.swapaxes(lse.reshape(b, t, g * r), 1, 2)  # [b, n, t], cuDNN's layout
        typed = zeros_varying_like((), q, k, v, out, lse, d_out)

        def run(causal):
            dq, dk, dv = self.kernel.backward(flat(q), k, v, flat(out), stats, flat(d_out),
                                              causal, self.scale)
            return tuple(x + typed.astype(x.dtype)
                         for x in (dq.reshape(q.shape), dk, dv))

        nothing = lambda: tuple(jnp.zeros_like(x) + typed.astype(x.dtype) for x in (q, k, v))
        return self._when_visible(run, nothing)
