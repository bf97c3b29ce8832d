"""Uneven pipeline stages (`parallel.stage_layers`): the padded stage layout, the
balance `auto` picks, the model's padding layers, and the one-line errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework.config import ModelConfig, ParallelConfig, TrainConfig
from framework.engine.resolved import with_stage_layers as resolve_stage_layers
from framework.engine.validate import check
from framework.model.flops import stage_flops_per_token
from framework.errors import ConfigError
from framework.engine.validate import validate
from framework.model.llama import init_params
from framework.model.stack import Stack, apply_layers
from framework.parallel.pipeline import layout, schedule as schedules
from framework.parallel.pipeline.stage import skip_unless

TRAIN = TrainConfig(seq_len=16, global_batch_size=16)


@pytest.mark.parametrize("p,v,v_shape,counts", [(2, 1, False, (6, 4)), (4, 1, False, (2, 3, 3, 2)),
                                              (2, 2, False, (3, 2, 2, 3)), (2, 2, True, (1, 4, 3, 2))])
def test_padded_stage_layout_places_each_stage_and_round_trips(p, v, v_shape, counts):
    layers = np.arange(sum(counts) * 3).reshape(sum(counts), 3) + 1  # no zero rows
    stages = layout.to_stages(layers, p, v, v_shape, counts)  # [rank, chunk, Lc, 3]
    assert stages.shape == (p, v, max(counts), 3)
    placement = schedules.V_SHAPE if v_shape else schedules.INTERLEAVED
    start = np.concatenate([[0], np.cumsum(counts)])
    for (r, c), g in np.ndenumerate(schedules.stage_map(placement, p, v).of):
        n = counts[g]
        assert (stages[r, c, :n] == layers[start[g]:start[g] + n]).all()
        assert (stages[r, c, n:] == 0).all()  # the padding: zero layers
    assert (layout.to_layers(stages, v_shape, counts) == layers).all()
    on_device = layout.to_stages(jnp.asarray(layers), p, v, v_shape, counts)
    assert (np.asarray(on_device) == stages).all()


def _brute_force(n_layers, costs):
    best = None
    for split in itertools.product(range(1, n_layers + 1), repeat=len(costs)):
        if sum(split) == n_layers:
            worst = max(n + e for n, e in zip(split, costs))
            best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("n_layers,stages,first,last", [
    (30, 4, 0.0, 0.0), (9, 4, 0.0, 2.4), (10, 3, 1.5, 0.7), (12, 5, 0.0, 0.65), (7, 2, 3.0, 0.0)])
def test_auto_balance_reaches_the_brute_force_optimum(n_layers, stages, first, last):
    counts = layout.balance(n_layers, stages, 1.0, first, last)
    assert sum(counts) == n_layers and min(counts) >= 1
    extra = [first] + [0.0] * (stages - 2) + [last]
    assert max(n + e for n, e in zip(counts, extra)) == pytest.approx(
        _brute_force(n_layers, extra))


def test_auto_takes_layers_off_the_head_stage_of_a_large_vocabulary():
    llama8b = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                          n_kv_heads=8, d_ff=14336)
    layer, embed, head = stage_flops_per_token(llama8b, 8192)
    assert 2 < head / layer < 3 and embed == 0  # 2 d V vs ~ 2 x 218M + attention
    auto = ParallelConfig(pipeline=4, stage_layers="auto")
    counts = resolve_stage_layers(llama8b, auto, 8192).stage_layers
    assert sum(counts) == 32 and counts[-1] == min(counts) < 8
    thirty = ModelConfig(n_layers=30, vocab_size=64)
    assert resolve_stage_layers(thirty, auto, 16).stage_layers == (8, 8, 7, 7)
    even = ModelConfig(n_layers=8, vocab_size=64)  # equal counts: the even layout
    assert resolve_stage_layers(even, auto, 16).stage_layers is None


@pytest.mark.slow
def test_padding_layers_pass_their_input_and_get_zero_gradients():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64)
    layers = jax.jit(lambda k: init_params(cfg, k))(jax.random.key(1))["layers"]
    x = jax.random.normal(jax.random.key(2), (2, 8, 32))
    first3 = jax.tree.map(lambda a: a[:3], layers)
    for remat in ("none", "full"):
        padded = lambda w, x: apply_layers(cfg, w, x, Stack(remat, skip=skip_unless),
                                           n_real=jnp.int32(3)).sum()
        plain = lambda w, x: apply_layers(cfg, w, x, Stack(remat)).sum()
        (y, (gw, gx)), (ry, (rw, rx)) = (jax.jit(jax.value_and_grad(f, (0, 1)))(w, x)
                                         for f, w in ((padded, layers), (plain, first3)))
        np.testing.assert_allclose(y, ry, rtol=1e-6)
        np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-6)
        for g, r in zip(jax.tree.leaves(gw), jax.tree.leaves(rw)):
            np.testing.assert_allclose(g[:3], r, rtol=1e-5, atol=1e-6)
            assert not np.asarray(g[3]).any()


@pytest.mark.parametrize("settings,message", [
    ({"stage_layers": (3, 3)}, "parallel.stage_layers=[3,3] has 2 stages but parallel.pipeline=4: "
                               "give 4 layer counts, or auto"),
    ({"stage_layers": (3, 3, 3, 3)}, "parallel.stage_layers=[3,3,3,3] adds up to 12 layers but "
                                     "model.n_layers=10"),
    ({}, "model.n_layers=10 is not divisible by parallel.pipeline=4: use a divisor of 10 "
         "(1, 2, 5, 10) or parallel.stage_layers=auto (uneven stages)"),
    ({"schedule": "zb_v", "stage_layers": (2, 3, 3, 2)}, "has 4 stages but "
     "parallel.pipeline*chunks per rank=8"),
])
def test_impossible_stage_layouts_are_one_line_errors(settings, message):
    model = ModelConfig(n_layers=10, vocab_size=64)
    par = ParallelConfig(pipeline=4, microbatches=8, **settings)
    errs = check(model, par, TRAIN, 4)
    assert len(errs) == 1 and message in errs[0], errs
    with pytest.raises(ConfigError, match="stage"):
        validate(model, par, TRAIN, 4)


def test_valid_uneven_layouts_validate_and_auto_is_resolved():
    model = ModelConfig(n_layers=10, vocab_size=64)
    par = validate(model, ParallelConfig(pipeline=4, microbatches=8, stage_layers=[2, 3, 3, 2]),
                   TRAIN, 4)
    assert par.stage_layers == (2, 3, 3, 2)
    auto = validate(model, ParallelConfig(pipeline=4, microbatches=8, stage_layers="auto"),
                    TRAIN, 4)
    assert sum(auto.stage_layers) == 10 and len(auto.stage_layers) == 4
