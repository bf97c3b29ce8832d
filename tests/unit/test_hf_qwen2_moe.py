"""Qwen2-MoE's config.json (tests/fixtures/hf/qwen2_moe, written by transformers) <->
model.moe: its sigmoid-gated shared expert read and written, every other layout refused
in one line naming the key (framework/io/hf/moe.py). Its logits, greedy tokens and
bit-exact re-export: tests/parity/test_hf.py and test_generate.py."""

import dataclasses

import pytest

from framework.config import MoeConfig
from framework.errors import ConfigError
from framework.io.hf import family
from tests.helpers import FIXTURES

QWEN2_MOE = family.read_config(FIXTURES / "hf" / "qwen2_moe")


def test_the_folder_reads_as_qwen2s_attention_and_a_gated_shared_expert():
    cfg = family.model_config(QWEN2_MOE)
    assert cfg.family == "qwen2_moe" and cfg.has_qkv_bias and not cfg.has_qk_norm
    assert cfg.moe == MoeConfig(experts=4, top_k=2, expert_hidden=24, renormalize=False,
                                shared_experts=1, shared_hidden=40, shared_gate=True)
    # absent or null: transformers' defaults (every layer sparse, not renormalised)
    bare = {k: v for k, v in QWEN2_MOE.items()
            if k not in ("decoder_sparse_step", "norm_topk_prob", "qkv_bias")}
    assert family.model_config({**bare, "mlp_only_layers": None}) == cfg
    assert family.model_config({**QWEN2_MOE, "norm_topk_prob": True}).moe.renormalize
    assert family.model_config({**QWEN2_MOE, "output_router_logits": True}
                               ).moe.aux_loss_coef == 0.001
    # dense layers first (mlp_only_layers [0]) beside its shared expert
    first = family.model_config({**QWEN2_MOE, "mlp_only_layers": [0]}).moe
    assert first.first_dense == 1 and first.shared_experts == 1 and first.shared_gate
    # its window is on the layers below max_window_layers: none below 0
    assert family.model_config({**QWEN2_MOE, "use_sliding_window": True, "sliding_window": 8,
                                "layer_types": None, "max_window_layers": 0}).moe.enabled


@pytest.mark.parametrize("change,message", [
    (dict(decoder_sparse_step=3), "decoder_sparse_step=3 with 2 layers after the first 0 "
                                  "is not supported (only groups of 3 layers"),
    (dict(mlp_only_layers=[1]), "mlp_only_layers=[1] is not supported (only the first layers "
                                "dense, [0, 1, ..., k-1]"),
    (dict(shared_expert_intermediate_size=0),
     "shared_expert_intermediate_size=0 is not a whole number >= 1"),
    (dict(shared_expert_intermediate_size=None),
     "shared_expert_intermediate_size=None is not a whole number >= 1"),
    (dict(routed_scaling_factor=2.5), "routed_scaling_factor=2.5 is not supported for "
                                      "model_type qwen2_moe (one sigmoid-gated shared expert"),
    (dict(n_shared_experts=2), "n_shared_experts=2 is not supported for model_type qwen2_moe"),
    (dict(qkv_bias=False), "qkv_bias=False is not supported (only True)"),
    # (transformers: layer 0 slides, being below max_window_layers 28)
    (dict(use_sliding_window=True, sliding_window=8, layer_types=None, max_window_layers=28),
     "sliding_window=8 (below max_position_embeddings=128) is not supported"),
    (dict(layer_types=["sliding_attention", "full_attention"]),
     "layer_types holds 'sliding_attention'"),
])
def test_what_qwen2_moe_runs_otherwise_is_refused_in_one_line(change, message):
    with pytest.raises(ConfigError) as err:
        family.model_config({**QWEN2_MOE, **change}, "x/config.json")
    assert str(err.value).startswith("x/config.json: ") and "\n" not in str(err.value)
    assert message in str(err.value), str(err.value)


def test_export_and_start_hold_the_gated_shared_expert_and_nothing_else():
    """export_config writes what model_config reads back; settings a qwen2_moe folder
    cannot hold (no shared expert, an ungated one, a sigmoid router) are refused on
    export and, given against a folder's own, on train.init_from, in one line."""
    cfg = family.model_config(QWEN2_MOE)
    out = family.export_config(cfg, "float32", QWEN2_MOE)
    assert out["architectures"] == ["Qwen2MoeForCausalLM"] and out["qkv_bias"] is True
    assert (out["shared_expert_intermediate_size"], out["moe_intermediate_size"]) == (40, 24)
    assert family.model_config(out) == family.model_config(
        family.export_config(cfg, "float32")) == cfg
    assert family.merge_model({"moe": cfg.moe}, cfg, "x") == cfg
    for moe, said, advice in (
            (dict(shared_experts=0, shared_hidden=None, shared_gate=False),
             "model.moe.shared_experts=0, model.moe.shared_gate=False: a qwen2_moe folder ",
             "set model.moe.shared_experts=1 model.moe.shared_gate=true"),
            (dict(router="sigmoid"), "model.moe.router=sigmoid: ", "model.moe.router=softmax")):
        with pytest.raises(ConfigError) as err:
            family.export_config(dataclasses.replace(
                cfg, moe=dataclasses.replace(cfg.moe, **moe)), "float32")
        assert str(err.value).startswith(said) and advice in str(err.value), str(err.value)
        assert "has one sigmoid-gated shared expert" in str(err.value)
    # given the defaults (as a recipe's model.moe says them): the folder's; else refused
    given = {"shared_experts": 0, "shared_hidden": None, "shared_gate": False,
             "aux_loss_coef": 0.5}
    assert family.merge_model({"moe": given}, cfg, "x").moe == dataclasses.replace(
        cfg.moe, aux_loss_coef=0.5)
    with pytest.raises(ConfigError, match=r"^model.moe.shared_hidden=16: x has one "
                                          r"sigmoid-gated shared expert .*drop these"):
        family.merge_model({"moe": {**given, "shared_hidden": 16}}, cfg, "x")
