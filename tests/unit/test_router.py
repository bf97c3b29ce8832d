"""DeepSeek-V3's routing (framework/model/router.py): the auxiliary-loss-free balancing
bias (`model.moe.bias_update_rate`) picks the top-k and nothing else, its step is
gamma x sign(mean load - load), it takes no gradient; group-limited routing
(`model.moe.expert_groups`, `top_groups`) as transformers' DeepseekV3TopkRouter
computes it, written out in numpy here; their settings refused in one line where they
cannot work. (Every layout moves the bias as one device does, groups on:
tests/parity/test_moe_balance.py.)"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework.config import ModelConfig, MoeConfig
from framework.errors import ConfigError
from framework.model import moe, router
from framework.model.llama import check_model, weights_outside_weight_op

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64,
                  moe=MoeConfig(experts=6, top_k=2, expert_hidden=24, router="sigmoid",
                                routed_scale=2.5, bias_update_rate=0.1))


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_bias_picks_the_experts_and_the_scores_weigh_them(renormalize):
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, renormalize=renormalize))
    logits = np.asarray(jax.random.normal(jax.random.key(0), (40, 6)), np.float32)
    bias = np.array([0.0, 0.3, -0.4, 0.0, 0.2, -0.1], np.float32)
    weights, ids = router.route(cfg, jnp.asarray(logits), jnp.asarray(bias))
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    want_ids = np.argsort(-(s + bias), axis=1, kind="stable")[:, :2]
    want = np.take_along_axis(s, want_ids, axis=1)
    if renormalize:
        want = want / want.sum(1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), 2.5 * want, rtol=1e-6)
    unbiased = np.argsort(-s, axis=1, kind="stable")[:, :2]
    assert (want_ids != unbiased).any()  # the bias changed some tokens' experts
    g = jax.grad(lambda b: jnp.sum(router.route(cfg, jnp.asarray(logits), b)[0]))(
        jnp.asarray(bias))
    assert not np.asarray(g).any()  # and takes no gradient


def test_the_bias_step_against_the_mean_load():
    counts = np.array([[9, 1, 4, 6], [5, 5, 5, 5], [0, 0, 0, 0]], np.float32)  # last: padding
    bias = np.array([[0.5, 0.0, 0.0, -0.5], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.0, 0.0]],
                    np.float32)
    got = np.asarray(router.update_bias(jnp.asarray(bias), jnp.asarray(counts), 0.01))
    want = bias + 0.01 * np.array([[-1, 1, 1, -1], [0, 0, 0, 0], [0, 0, 0, 0]], np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


def test_the_layer_holds_the_bias_outside_the_weight_ops():
    """One bias [E] a layer, zero at first; the zero-bubble W pass may skip it (no
    gradient), so it is not named among the weights a split backward would miss."""
    x = jnp.zeros((2, 8, CFG.d_model))
    params = nn.meta.unbox(moe.MoE(CFG).init(jax.random.key(1), x)["params"])
    assert params[router.BIAS].shape == (6,) and not np.asarray(params[router.BIAS]).any()
    assert weights_outside_weight_op(CFG) == []
    off = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, bias_update_rate=0.0))
    assert router.BIAS not in nn.meta.unbox(moe.MoE(off).init(jax.random.key(1), x)["params"])


def test_bad_balancing_settings_are_one_line():
    errs = check_model(dataclasses.replace(CFG, moe=dataclasses.replace(
        CFG.moe, bias_update_rate=-0.001)))
    assert errs == ["model.moe.bias_update_rate=-0.001 must be >= 0 (0: no balancing bias)"]
    from framework.config import OptimConfig, ParallelConfig
    from framework.engine.build import build_engine
    with pytest.raises(ConfigError) as err:
        build_engine(CFG, ParallelConfig(), OptimConfig(param_dtype="bfloat16"), 10, None)
    assert str(err.value).startswith("model.moe.bias_update_rate=0.1 needs "
                                     "optim.param_dtype=float32") and "\n" not in str(err.value)


def by_hand(choice, groups: int, top_groups: int, k: int):
    """DeepSeek-V3's group-limited top-k in numpy: each group's score the sum of its two
    best, the top_groups groups kept, the rest masked to -inf (DeepSeek's inference
    code; transformers' DeepseekV3TopkRouter fills 0), then the top k."""
    t, e = choice.shape
    per = choice.reshape(t, groups, e // groups)
    best = np.sort(per, axis=-1)[..., -2:].sum(-1)  # [T, G]
    kept = np.argsort(-best, axis=1, kind="stable")[:, :top_groups]
    mask = np.zeros((t, groups), bool)
    np.put_along_axis(mask, kept, True, axis=1)
    masked = np.where(np.repeat(mask, e // groups, axis=1), choice, -np.inf)
    return np.argsort(-masked, axis=1, kind="stable")[:, :k]


@pytest.mark.parametrize("with_bias", [False, True])
def test_group_limited_routing_as_deepseek_v3(with_bias):
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(
        CFG.moe, experts=16, top_k=4, expert_groups=4, top_groups=2))
    logits = np.asarray(jax.random.normal(jax.random.key(3), (64, 16)), np.float32)
    bias = np.linspace(-0.3, 0.3, 16).astype(np.float32) if with_bias else np.zeros(16, np.float32)
    weights, ids = router.route(cfg, jnp.asarray(logits),
                                jnp.asarray(bias) if with_bias else None)
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    want = by_hand(s + bias, 4, 2, 4)
    np.testing.assert_array_equal(np.sort(np.asarray(ids), 1), np.sort(want, 1))
    groups_used = np.unique(np.asarray(ids) // 4, axis=None)
    assert all(len(np.unique(row // 4)) <= 2 for row in np.asarray(ids)) and len(groups_used) == 4
    chosen = np.take_along_axis(s, np.asarray(ids), axis=1)
    np.testing.assert_allclose(np.asarray(weights), 2.5 * chosen / chosen.sum(1, keepdims=True),
                               rtol=1e-6)
    assert (np.sort(want, 1) != np.sort(by_hand(s, 1, 1, 4), 1)).any()  # the groups mattered


@pytest.mark.parametrize("change,message", [
    (dict(expert_groups=4), "model.moe.expert_groups=4 must divide model.moe.experts=6 (1: "
                            "no groups)"),
    (dict(expert_groups=3, top_groups=4), "model.moe.top_groups=4 must be in [1, "
                                          "model.moe.expert_groups=3]"),
    (dict(expert_groups=6, top_groups=1), "model.moe.top_k=2 is more than the experts of "
                                          "model.moe.top_groups=1 groups of 1"),
])
def test_bad_group_settings_are_one_line(change, message):
    errs = check_model(dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, **change)))
    assert errs == [message], errs


def test_a_uniform_bias_below_zero_routes_as_none():
    """A bias pushed below 0 everywhere shifts every choice score alike: the experts
    chosen stay (the masked groups' experts never win, as they would if masked to 0)."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(
        CFG.moe, experts=4, top_k=1, expert_groups=2, top_groups=1))
    logits = jnp.array([[2.0, 1.9, -3.0, -3.0]])
    plain = router.route(cfg, logits)[1]
    shifted = router.route(cfg, logits, jnp.full((4,), -0.95))[1]
    assert int(plain[0, 0]) == 0 and int(shifted[0, 0]) == 0
