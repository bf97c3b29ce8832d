"""AdamW's weight decay: matrices only (never norm scales), embeddings and name
patterns as settings; the learning-rate schedules; a bfloat16 first moment."""

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


def _lrs(steps=100, **kw):
    from framework.engine.optim import lr_schedule

    cfg = OptimConfig(**{"lr": 1.0, "warmup_steps": 10, "min_lr_ratio": 0.1, **kw})
    f = lr_schedule(cfg, steps)
    return np.array([float(f(s)) for s in range(steps + 1)])


def test_each_schedule_warms_up_then_ends_at_its_floor():
    for name in ("cosine", "linear", "wsd"):
        lr = _lrs(schedule=name)
        np.testing.assert_allclose(lr[:11], np.arange(11) / 10, atol=1e-6)  # the warmup
        assert lr[100] == np.float32(0.1) or abs(lr[100] - 0.1) < 1e-6, name
        assert np.all(np.diff(lr[10:]) <= 1e-7), name  # never rises after the warmup
    np.testing.assert_allclose(_lrs(schedule="constant")[10:], 1.0)
    linear = _lrs(schedule="linear")
    np.testing.assert_allclose(linear[55], 0.1 + 0.9 * 0.5, atol=1e-6)  # halfway down


def test_wsd_is_stable_until_its_decay_then_takes_its_shape():
    lr = _lrs(schedule="wsd", decay_steps=20)
    np.testing.assert_allclose(lr[10:81], 1.0)  # stable until step 80
    np.testing.assert_allclose(lr[90], 0.1 + 0.9 * 0.5, atol=1e-6)  # linear halfway
    sq = _lrs(schedule="wsd", decay_steps=20, decay_shape="sqrt")
    np.testing.assert_allclose(sq[85], 0.1 + 0.9 * (1 - np.sqrt(0.25)), atol=1e-6)
    cos = _lrs(schedule="wsd", decay_steps=20, decay_shape="cosine")
    np.testing.assert_allclose(cos[90], 0.1 + 0.9 * 0.5, atol=1e-6)
    assert cos[85] > lr[85] > sq[85]  # cosine keeps the rate longest, sqrt drops first
    # A cooldown branched at step 60 of a longer run: resume with steps = 60 + 20.
    branch = _lrs(steps=80, schedule="wsd", decay_steps=20)
    np.testing.assert_allclose(branch[:61], _lrs(steps=200, schedule="wsd")[:61])
    np.testing.assert_allclose(branch[70], 0.55, atol=1e-6)


def test_no_decay_patterns_and_a_bfloat16_first_moment():
    p = params(MODEL)
    mask = decay_mask(p, no_decay=("layers/attn/*", "head/w"))
    assert not mask["layers"]["attn"]["wqkv"] and not mask["layers"]["attn"]["wo"]
    assert not mask["head"]["w"] and mask["layers"]["mlp"]["w_down"] and mask["embed"]["table"]
    # the train layout's `stages` read as `layers`
    staged = decay_mask({"stages": p["layers"]}, no_decay=("layers/mlp/*",))["stages"]
    assert not staged["mlp"]["w_down"] and staged["attn"]["wqkv"]
    opt = make_optimizer(OptimConfig(mu_dtype="bfloat16"), total_steps=10)
    state = opt.init(p)
    adam = state[1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
    assert {a.dtype for a in jax.tree.leaves(adam.mu)} == {jnp.dtype("bfloat16")}
    assert {a.dtype for a in jax.tree.leaves(adam.nu)} == {jnp.dtype("float32")}
