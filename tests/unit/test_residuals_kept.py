"""What autodiff keeps of a layer for its backward (framework/model/layers.py): the gated
MLP's activation is recomputed from gate_up; the numbers are the written form's (plain
autodiff of act(gate) * up), the residuals fewer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework.model import layers
from framework.model.llama import Block
from tests.helpers import MODEL


def _written(cfg, gate_up):
    return layers.ACTIVATIONS[cfg.mlp_activation](gate_up[..., 0, :]) * gate_up[..., 1, :]


@pytest.mark.parametrize("activation", sorted(layers.ACTIVATIONS))
def test_the_recomputed_activation_equals_the_written_form(activation):
    """Values and the gradient of gate_up, SwiGLU and Gemma 2's GeGLU."""
    cfg = dataclasses.replace(MODEL, activation=activation)
    gate_up = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 2, 16), jnp.float32)
    dy = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 16), jnp.float32)
    fast, fast_vjp = jax.vjp(lambda g: layers.gated(cfg, g), gate_up)
    ref, ref_vjp = jax.vjp(lambda g: _written(cfg, g), gate_up)
    np.testing.assert_array_equal(fast, ref)
    np.testing.assert_allclose(fast_vjp(dy)[0], ref_vjp(dy)[0], rtol=1e-6, atol=1e-7)


def _kept_bytes(cfg, x):
    block = Block(cfg)
    p = block.init(jax.random.PRNGKey(0), x)
    loss = lambda p, x: jnp.sum(block.apply(p, x).astype(jnp.float32))
    _, vjp_fn = jax.vjp(loss, p, x)  # its leaves: what the backward reads
    arguments = {id(a) for a in jax.tree.leaves((p, x))}
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(vjp_fn)
               if id(a) not in arguments)


def test_a_layer_keeps_gate_up_not_the_activations_intermediates():
    """One bfloat16 layer (dense attention) keeps three [..., d_ff] arrays fewer than with
    the written activation: gate_up (two) and the product the down projection reads,
    against the gate, the up, three of SiLU's intermediates and the product."""
    cfg = dataclasses.replace(MODEL, dtype="bfloat16")
    x = jnp.ones((2, 16, cfg.d_model), jnp.bfloat16)
    kept = _kept_bytes(cfg, x)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layers, "gated", _written)
        written = _kept_bytes(cfg, x)
    tokens = x.shape[0] * x.shape[1]
    assert written - kept == tokens * 3 * cfg.d_ff * 2, (written, kept)  # bf16
