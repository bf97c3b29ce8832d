"""AdamW's weight decay: matrices only (never norm scales), embeddings as a setting."""

import jax
import jax.numpy as jnp
import numpy as np

from framework.config import OptimConfig
from framework.engine.optim import decay_mask, make_optimizer
from tests.helpers import MODEL, params


def test_weight_decay_skips_norm_scales_and_embeddings_only_when_asked():
    p = params(MODEL)
    mask = decay_mask(p)
    assert not mask["layers"]["attn_norm"]["scale"] and not mask["head"]["norm"]["scale"]
    assert mask["layers"]["attn"]["wqkv"] and mask["head"]["w"] and mask["embed"]["table"]
    assert not decay_mask(p, decay_embeddings=False)["embed"]["table"]
    # One step with zero gradients moves exactly the decayed parameters (lr * wd * p).
    for decay_embeddings in (True, False):
        cfg = OptimConfig(lr=0.1, warmup_steps=0, weight_decay=0.5, grad_clip=0.0,
                          decay_embeddings=decay_embeddings)
        opt = make_optimizer(cfg, total_steps=10)
        zeros = jax.tree.map(jnp.zeros_like, p)
        updates, _ = opt.update(zeros, opt.init(p), p)
        moved = jax.tree.map(lambda u: bool(np.any(np.asarray(u) != 0)), updates)
        assert moved == decay_mask(p, decay_embeddings)
        np.testing.assert_allclose(updates["layers"]["mlp"]["w_down"],
                                   -0.1 * 0.5 * p["layers"]["mlp"]["w_down"], rtol=1e-6)
