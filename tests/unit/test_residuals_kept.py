"""What autodiff keeps of a layer for its backward (framework/model/layers.py): RMSNorm's
own VJP (`rms_norm`) keeps x and one float32 per row, the gated MLP's activation is
recomputed from gate_up; the numbers are the written form's (`rms_norm_reference`,
plain autodiff), the residuals fewer."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework.model import layers
from framework.model.llama import Block
from tests.helpers import MODEL


def _rows(dtype, shape=(3, 5, 64), scale=1.0):
    x = jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32) * scale
    w = 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(1), shape[-1:], jnp.float32)
    dy = jax.random.normal(jax.random.PRNGKey(2), shape, jnp.float32)
    return x.astype(dtype), w, dy.astype(dtype)


@pytest.mark.parametrize("dtype,scale", [(jnp.float32, 1.0), (jnp.float32, 1e3),
                                         (jnp.bfloat16, 1.0), (jnp.float32, 1e-4)])
def test_rms_norm_equals_the_written_form_and_its_gradients(dtype, scale):
    """Forward and both gradients against autodiff of the written form, including rows
    far from unit scale (the eps term) and bfloat16 inputs (the cast at the end)."""
    x, w, dy = _rows(dtype, scale=scale)
    eps = 1e-6
    fast, fast_vjp = jax.vjp(partial(layers.rms_norm, eps=eps), x, w)
    ref, ref_vjp = jax.vjp(partial(layers.rms_norm_reference, eps=eps), x, w)
    np.testing.assert_array_equal(np.asarray(fast, np.float32), np.asarray(ref, np.float32))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: dx rounded to 8 bits either way
    for got, want in zip(fast_vjp(dy), ref_vjp(dy)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.max(np.abs(got - want)) <= tol * np.max(np.abs(want))


def test_rms_norm_with_a_zero_row():
    """An all-zero row (padding): rsqrt(eps), finite gradients, as the written form."""
    x, w, dy = _rows(jnp.float32)
    x = x.at[0, 0].set(0.0)
    fast = jax.grad(lambda x, w: jnp.sum(layers.rms_norm(x, w, 1e-6) * dy), (0, 1))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(layers.rms_norm_reference(x, w, 1e-6) * dy),
                   (0, 1))(x, w)
    for got, want in zip(fast, ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _kept_bytes(cfg, x):
    block = Block(cfg)
    p = block.init(jax.random.PRNGKey(0), x)
    loss = lambda p, x: jnp.sum(block.apply(p, x).astype(jnp.float32))
    _, vjp_fn = jax.vjp(loss, p, x)  # its leaves: what the backward reads
    arguments = {id(a) for a in jax.tree.leaves((p, x))}
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(vjp_fn)
               if id(a) not in arguments)


def test_a_layer_keeps_x_per_norm_and_gate_up_per_mlp():
    """One bfloat16 layer (dense attention) keeps what its matmuls and attention read,
    the norms' inputs and row statistics, gate_up and the MLP's output: against the
    written forms (the norm through plain autodiff, the activation kept), the norms'
    float32 copies fewer (x and the normalized x: 8 bytes an element each, less the
    second norm's bfloat16 input now kept) and 3 [..., f] arrays (the gate, the up and
    the activation's intermediates, 6, against gate_up, 2)."""
    cfg = dataclasses.replace(MODEL, dtype="bfloat16")
    x = jnp.ones((2, 16, cfg.d_model), jnp.bfloat16)
    kept = _kept_bytes(cfg, x)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layers, "rms_norm", layers.rms_norm_reference)
        plain_act = layers.ACTIVATIONS[cfg.mlp_activation]
        mp.setattr(layers, "gated", lambda c, gu: plain_act(gu[..., 0, :]) * gu[..., 1, :])
        written = _kept_bytes(cfg, x)
    tokens = x.shape[0] * x.shape[1]
    fewer = written - kept
    # per token: 2 x 8 d - 2 d bytes (measured: 1,688 of 1,664 predicted per token)
    assert fewer >= tokens * (14 * cfg.d_model + 6 * cfg.d_ff), (written, kept)
