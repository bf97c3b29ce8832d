"""The LM head's loss: token cross-entropy (+ z-loss) over a vocabulary-parallel head,
either over the whole batch's logits (the naive reference, `cross_entropy_sum`) or in
chunks of tokens without the batch's logits ever alive (`chunked_cross_entropy_sum`,
`model.loss_chunk`).

Chunked (`model.loss_chunk` = c > 0 tokens): the tokens [n, embed] are cut into k
equal chunks of at most c (k the smallest divisor of n that gets there, `chunk_count`)
and a scan computes each chunk's logits [c, vocab@tensor] in the compute dtype, their
log-sum-exp and the loss in float32, and, since the loss is the last thing the step
computes, its gradients right there: d logits = softmax (1 + 2 z log Z) - onehot, then
dx for the chunk and dw summed over the chunks in float32. The backward only scales
those by the incoming cotangent: no logits are recomputed and none are saved (a
custom VJP). Liger Kernel's fused linear cross-entropy (Hsu et al. 2024) computes the
gradients in the forward in the same way; torchtune's chunked cross-entropy and Cut
Cross-Entropy (Wijmans et al. 2024) also never hold the whole logits.

Per-token terms are defined once (`token_terms`): both paths compute the same
numbers, the chunked one a chunk at a time, so they agree to rounding
(tests/parity/test_chunked_loss.py). The logits are rounded to the compute dtype
before float32, as the naive head does, and so is d logits before its two matmuls
(as autodiff of the naive head's cast does).

Shapes: x [n, embed] (compute dtype), w [embed, vocab@tensor], targets [n] int32.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from framework.model.layers import NO_TP, softcap
from framework.parallel.vma import sum_to
from framework.parallel.tensor import TensorParallel

# The chunked loss's gradients (dx, dw: its custom VJP's residuals), by name: a remat
# policy that saves the weight matmuls' outputs saves these too (`REMAT_POLICIES`,
# framework/model/stack.py), else it would keep every chunk's dw product [k, embed,
# vocab@tensor] f32 to redo their sum in the backward (the head under FSDP per use).
GRADS = "loss_grads"


def token_terms(logits, targets, tp: TensorParallel = NO_TP, z_loss: float = 0.0):
    """Per token (loss, log Z) over vocabulary-parallel logits [..., vocab@tensor] f32
    (this device's slice), targets [...] int32. log Z = max + log sum exp(logits - max),
    both reduced over the vocabulary slices. `z_loss`: + z_loss * (log Z)^2 per token
    (PaLM, Chowdhery et al. 2022: keeps the softmax normaliser near 1, for bfloat16
    stability at scale)."""
    peak = tp.vocab_max(jax.lax.stop_gradient(jnp.max(logits, axis=-1)))  # [...]
    log_z = peak + jnp.log(tp.vocab_sum(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1)))
    label = tp.vocab_sum(jnp.sum(logits * _one_hot(targets, logits.shape[-1], tp), axis=-1))
    return log_z - label + (z_loss * log_z**2 if z_loss else 0.0), log_z


def _one_hot(targets, local_vocab: int, tp: TensorParallel):
    """[..., vocab@tensor] f32: 1 at the target where it falls in this device's slice."""
    return jax.nn.one_hot(targets - tp.vocab_offset(local_vocab), local_vocab)


def cross_entropy_sum(logits, targets, tp: TensorParallel = NO_TP, z_loss: float = 0.0):
    """The naive reference: the sum of token cross-entropies (+ z-loss) over the whole
    batch's logits [b, s, vocab@tensor] f32, targets [b, s] int32."""
    return jnp.sum(token_terms(logits, targets, tp, z_loss)[0])


def chunk_count(tokens: int, chunk: int) -> int:
    """Chunks of `tokens`: the fewest equal ones of at most `chunk` tokens each."""
    return next(k for k in range(-(-tokens // chunk), tokens + 1) if tokens % k == 0)


def chunked_cross_entropy_sum(x, w, targets, tp: TensorParallel = NO_TP,
                              z_loss: float = 0.0, cap: float | None = None, chunk: int = 0):
    """The sum of token cross-entropies (+ z-loss) of logits softcap(x @ w, cap), computed
    `chunk` tokens at a time. x [b, s, embed] and w [embed, vocab@tensor] in the compute
    dtype, targets [b, s] int32."""
    assert x.dtype == w.dtype, (x.dtype, w.dtype)
    n = x.shape[0] * x.shape[1]
    k = chunk_count(n, chunk)
    return _chunked(x.reshape(k, n // k, x.shape[-1]), w, targets.reshape(k, n // k),
                    tp, z_loss, cap)


def _logits(x_c, w, cap):
    """[c, vocab@tensor] f32: the compute dtype's product, widened, soft-capped."""
    return softcap((x_c @ w).astype(jnp.float32), cap)


def _chunk_loss(x_c, t_c, w, tp, z_loss, cap):
    """One chunk's loss sum: x_c [c, embed], t_c [c]."""
    return jnp.sum(token_terms(_logits(x_c, w, cap), t_c, tp, z_loss)[0])


def _chunk_grads(x_c, t_c, w, tp, z_loss, cap):
    """One chunk's (loss sum, dx [c, embed] compute dtype, dw [embed, vocab@tensor] f32)."""
    logits = _logits(x_c, w, cap)  # [c, vocab@tensor] f32
    terms, log_z = token_terms(logits, t_c, tp, z_loss)  # [c] each
    # d/dlogits of log Z - label + z (log Z)^2: softmax (1 + 2 z log Z) - onehot
    d = jnp.exp(logits - log_z[:, None]) * (1 + 2 * z_loss * log_z)[:, None]
    d = d - _one_hot(t_c, logits.shape[-1], tp)
    if cap is not None:  # d/draw of cap tanh(raw / cap) = 1 - tanh^2
        d = d * (1 - (logits / cap) ** 2)
    d = d.astype(x_c.dtype)  # as the naive head's cast back to the compute dtype
    dx = d @ w.T  # [c, embed]: this device's vocabulary slice's share
    dw = jnp.einsum("cd,cv->dv", x_c, d, preferred_element_type=jnp.float32)
    return jnp.sum(terms), dx, dw


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked(xs, w, ts, tp, z_loss, cap):
    """xs [k, c, embed], w [embed, vocab@tensor], ts [k, c] -> the loss sum."""
    def one(total, xt):
        return total + _chunk_loss(xt[0], xt[1], w, tp, z_loss, cap), None

    first = _chunk_loss(xs[0], ts[0], w, tp, z_loss, cap)  # its type (traced only)
    return jax.lax.scan(one, jnp.zeros_like(first), (xs, ts))[0]


def _chunked_fwd(xs, w, ts, tp, z_loss, cap):
    """The loss and its gradients at cotangent 1, chunk by chunk: dx [k, c, embed] as
    the scan's outputs, dw [embed, vocab@tensor] f32 summed in its carry."""
    def one(carry, xt):
        total, dw = carry
        loss, dx, dw_c = _chunk_grads(xt[0], xt[1], w, tp, z_loss, cap)
        return (total + loss, dw + dw_c), dx

    first = _chunk_grads(xs[0], ts[0], w, tp, z_loss, cap)  # their types (dead code)
    init = (jnp.zeros_like(first[0]), jnp.zeros_like(first[2]))
    (total, dw), dx = jax.lax.scan(one, init, (xs, ts))
    named = lambda a: checkpoint_name(a, GRADS)
    return total, (named(sum_to(dx, xs)), named(sum_to(dw, w)))  # typed like xs and w


def _chunked_bwd(tp, z_loss, cap, res, g):
    """The saved gradients times the cotangent g (a scalar); nothing recomputed. dw is
    rounded to the compute dtype (w's, as x's) once, after the float32 sum."""
    dx, dw = res
    return (sum_to(g * dx, dx).astype(dx.dtype), sum_to(g * dw, dw).astype(dx.dtype), None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


