"""DeepSeek-V3's auxiliary-loss-free balancing bias (`model.moe.bias_update_rate`,
framework/model/router.py) moves as on one device: three steps of a
sigmoid-routed, group-limited MoE on a pipelined, expert-, tensor- and data-parallel layout
(zero-bubble's split backward, ZeRO-1, sequence parallelism) against the naive reference,
whose bias moves by the loads a one-device forward counts (framework/model/
reference.py). Starting from a Hugging Face folder, the bias starts at 0; a folder cannot
hold it, so exporting a run that trained one is refused in one line."""

import dataclasses

import jax
import numpy as np
import pytest

from framework.config import MoeConfig
from framework.errors import ConfigError
from framework.io.hf import llama as hf
from framework.model.router import BIAS
from tests.helpers import (FIXTURES, MODEL, engine, engine_losses, max_rel_err,
                           reference_losses, worst)

# A large rate: the bias changes which experts tokens go to within three steps. Routed
# as DeepSeek-V3 does: the top 2 of 8 experts in each token's best 2 of 4 groups.
BALANCED = dataclasses.replace(MODEL, family="qwen3_moe", n_layers=4, moe=MoeConfig(
    experts=8, top_k=2, expert_hidden=32, router="sigmoid", routed_scale=2.5,
    bias_update_rate=0.05, expert_groups=4, top_groups=2))


@pytest.mark.slow  # ~7 s (the fast tier keeps the folder's bias check)
def test_the_reference_bias_moves_and_changes_the_loss():
    losses, final = reference_losses(3, model=BALANCED)
    off = dataclasses.replace(BALANCED, moe=dataclasses.replace(BALANCED.moe,
                                                                bias_update_rate=0.0))
    plain, _ = reference_losses(3, model=off)
    bias = np.asarray(final["layers"]["moe"][BIAS])  # [L, E]: three steps of +-0.05 or 0
    assert bias.shape == (4, 8) and np.abs(bias).max() > 0.04
    np.testing.assert_allclose(bias / 0.05, np.round(bias / 0.05), atol=1e-4)
    assert losses[0] == plain[0] and abs(losses[2] - plain[2]) > 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(pipeline=2, data=2, tensor=2, microbatches=4, expert=2, schedule="zb_h1",
         zero1=True, sequence_parallel=True),
], ids=lambda kw: kw["schedule"])
def test_a_pipelined_layout_moves_the_bias_as_one_device(kw):
    ref_losses, ref_params = reference_losses(3, model=BALANCED)
    losses, final = engine_losses(engine(model=BALANCED, **kw), 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(final["layers"]["moe"][BIAS], ref_params["layers"]["moe"][BIAS],
                               rtol=0, atol=1e-6)
    # three Adam steps amplify rounding: 1.2e-4 on a Xeon with AVX512-FP16 (2026-11-29)
    assert worst(max_rel_err(final, ref_params)) <= 3e-4


def test_a_folder_starts_the_bias_at_zero_and_cannot_take_it_back(tmp_path):
    folder = FIXTURES / "hf" / "qwen3_moe"
    cfg = hf.model_config(hf.read_config(folder))
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, bias_update_rate=0.001))
    mesh = jax.make_mesh((1,), ("one",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])
    shardings = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                             hf.canonical_shapes(cfg))
    params = jax.device_get(hf.load_params(folder, cfg, shardings))
    bias = params["layers"]["moe"][BIAS]
    assert bias.shape == (cfg.n_layers, cfg.moe.experts) and not bias.any()
    with pytest.raises(ConfigError) as err:
        hf.export(tmp_path, cfg, params, "float32", hf.read_config(folder))
    assert str(err.value).startswith("model.moe.bias_update_rate=0.001: a qwen3_moe folder "
                                     "has no balancing bias") and "\n" not in str(err.value)
