"""The mixture-of-experts feed-forward (framework/model/moe.py): the grouped expert
matmuls (ragged_dot) against the naive every-expert reference, the auxiliary losses'
gradient injection against the losses written out, and bad settings refused in one
line each."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework.config import ModelConfig, MoeConfig
from framework.model import moe, moe_slots
from framework.model.llama import check_model

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64,
                  moe=MoeConfig(experts=5, top_k=2, expert_hidden=24))


def setup(cfg=CFG):
    x = jax.random.normal(jax.random.key(0), (3, 8, cfg.d_model))
    params = nn.meta.unbox(moe.MoE(cfg).init(jax.random.key(1), x)["params"])
    # weights of unit scale: the routing and the experts' outputs differ clearly
    variables = {"params": jax.tree.map(lambda w: w * 20, params)}
    return x, variables


@pytest.mark.parametrize("renormalize", [pytest.param(True, marks=pytest.mark.slow), False])
def test_grouped_experts_equal_the_dense_reference_forward_and_backward(renormalize):
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, renormalize=renormalize))
    x, variables = setup(cfg)
    r = jax.random.normal(jax.random.key(2), x.shape)

    def loss(v, x, dense):
        return jnp.sum(moe.MoE(cfg, dense=dense).apply(v, x) * r)

    grouped = jax.value_and_grad(loss, (0, 1))(variables, x, False)
    dense = jax.value_and_grad(loss, (0, 1))(variables, x, True)
    np.testing.assert_allclose(grouped[0], dense[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grouped[1]), jax.tree.leaves(dense[1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))
    assert float(jnp.abs(grouped[1][0]["params"]["router"]).max()) > 0
    assert not np.allclose(grouped[0], loss(variables, x[:, ::-1], False))


# DeepSeek-V3's settings (sigmoid router, routed_scale) with a Qwen2-MoE-style gated
# shared expert two experts wide
SHARED = dataclasses.replace(CFG, moe=dataclasses.replace(
    CFG.moe, router="sigmoid", routed_scale=2.5, shared_experts=2, shared_gate=True))


def naive_moe(cfg, params, x):
    """The layer written out in float32 from the settings' definitions (MoeConfig): the
    router's scores, each token's top_k by a sort, every expert and the shared expert on
    every token, as separate matmuls."""
    m, p = cfg.moe, params["params"]
    t = x.reshape(-1, cfg.d_model)
    logits = t @ p["router"]
    s = jax.nn.sigmoid(logits) if m.router == "sigmoid" else jax.nn.softmax(logits, -1)
    ids = jnp.argsort(-s, axis=-1, stable=True)[:, :m.top_k]
    w = jnp.take_along_axis(s, ids, axis=-1)
    w = (w / jnp.sum(w, -1, keepdims=True) if m.renormalize else w) * m.routed_scale

    def mlp(w_in, w_down):
        return (jax.nn.silu(t @ w_in[:, 0]) * (t @ w_in[:, 1])) @ w_down

    y = sum(jnp.sum(jnp.where(ids == e, w, 0.0), -1, keepdims=True)
            * mlp(p["w_gate_up"][e], p["w_down"][e]) for e in range(m.experts))
    if m.shared_experts:
        shared = mlp(p["shared_gate_up"], p["shared_down"])
        y = y + (shared * jax.nn.sigmoid(t @ p["shared_gate"]) if m.shared_gate else shared)
    return y.reshape(x.shape)


@pytest.mark.parametrize("cfg", [SHARED, dataclasses.replace(SHARED, moe=dataclasses.replace(
    SHARED.moe, router="softmax", shared_gate=False, shared_hidden=16, routed_scale=1.0))],
    ids=["sigmoid_gated", "softmax_shared16"])
def test_shared_experts_and_sigmoid_router_equal_the_naive_layer(cfg):
    """Forward and every gradient of the grouped layer (and its dense-routing mode) with
    shared experts equal `naive_moe`'s; the shared expert's leaves are [embed, 2,
    shared width], [shared width, embed] and the gate [embed, 1]."""
    x, variables = setup(cfg)
    p = variables["params"]
    width = cfg.moe.shared_hidden or 2 * 24
    assert p["shared_gate_up"].shape == (cfg.d_model, 2, width)
    assert p["shared_down"].shape == (width, cfg.d_model)
    assert ("shared_gate" in p) == cfg.moe.shared_gate
    r = jax.random.normal(jax.random.key(2), x.shape)
    want = jax.value_and_grad(lambda v, x: jnp.sum(naive_moe(cfg, v, x) * r), (0, 1))(
        variables, x)
    for dense in (False, True):
        got = jax.value_and_grad(lambda v, x: jnp.sum(moe.MoE(cfg, dense=dense).apply(v, x)
                                                      * r), (0, 1))(variables, x)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))
    assert float(jnp.abs(want[1][0]["params"]["shared_down"]).max()) > 0


def test_shared_expert_weights_go_through_weight_op_and_split_over_tensor():
    """Every shared leaf is read by a weight_op (the zero-bubble W pass replays them), and
    the layout check refuses an expert or shared width that `tensor` does not divide."""
    from framework.config import ParallelConfig, TrainConfig
    from framework.engine.validate import check
    from framework.model.llama import weights_outside_weight_op

    assert weights_outside_weight_op(SHARED) == []
    odd = dataclasses.replace(SHARED, moe=dataclasses.replace(SHARED.moe, shared_hidden=15))
    errs = check(odd, ParallelConfig(tensor=2), TrainConfig(seq_len=8, global_batch_size=8), 2)
    assert errs == ["model.moe.shared_hidden (width 15) is not divisible by "
                    "parallel.tensor=2: use tensor in {1, 3, 5, 15}"]


def test_sigmoid_load_balancing_loss_uses_the_normalised_scores():
    """Of a sigmoid router, P_e is the mean of s_e / sum_j s_j (DeepSeek-V3's sequence-wise
    balance loss's normalised scores); f_e from the top-k of the scores."""
    e, k = 4, 2
    cfg = dataclasses.replace(CFG, moe=MoeConfig(experts=e, top_k=k, router="sigmoid"))
    logits = jax.random.normal(jax.random.key(0), (50, e))
    s = jax.nn.sigmoid(logits)
    hits = jax.nn.one_hot(jax.lax.top_k(s, k)[1], e)  # [T, k, E]
    share = s / jnp.sum(s, -1, keepdims=True)
    want = e * jnp.sum(jnp.mean(hits, 0) * jnp.mean(share, 0)[None])
    aux, z = moe.router_loss_values(cfg, logits)
    np.testing.assert_allclose(aux, want, rtol=1e-6)
    np.testing.assert_allclose(z, jnp.mean(jax.nn.logsumexp(logits, -1) ** 2), rtol=1e-6)
    weights, ids = moe.route(dataclasses.replace(cfg, moe=dataclasses.replace(
        cfg.moe, routed_scale=2.5)), logits)
    np.testing.assert_allclose(jnp.sum(weights, -1), 2.5, rtol=1e-6)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_the_injected_gradient_is_the_aux_and_z_losses_gradient(router):
    """The identity on the router logits adds the gradient of coef x (E sum f P) and
    z_coef x mean lse^2, written out here (f: no gradient, as transformers' one-hot)."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, aux_loss_coef=0.3,
                                                           z_loss_coef=0.05, router=router))
    plain = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, aux_loss_coef=0.0,
                                                             z_loss_coef=0.0))
    x, variables = setup(cfg)
    r = jax.random.normal(jax.random.key(2), x.shape)

    def injected(v):
        return jnp.sum(moe.MoE(cfg).apply(v, x) * r)

    def written_out(v):
        logits = (x @ v["params"]["router"]).reshape(-1, cfg.moe.experts)
        aux, z = moe.router_loss_values(cfg, logits)
        return jnp.sum(moe.MoE(plain).apply(v, x) * r) + 0.3 * aux + 0.05 * z

    got, want = jax.grad(injected)(variables), jax.grad(written_out)(variables)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))
    no_loss = jax.grad(lambda v: jnp.sum(moe.MoE(plain).apply(v, x) * r))(variables)
    assert not np.allclose(no_loss["params"]["router"], want["params"]["router"])


def test_load_balancing_loss_as_transformers_computes_it():
    """E sum_e f_e P_e with f from the top-k hits (transformers' load_balancing_loss_func,
    one layer, no mask): a uniform router gives top_k; all tokens on one expert more."""
    e, k = 4, 2
    cfg = dataclasses.replace(CFG, moe=MoeConfig(experts=e, top_k=k))
    logits = jax.random.normal(jax.random.key(0), (50, e))
    probs = jax.nn.softmax(logits, -1)
    hits = jax.nn.one_hot(jax.lax.top_k(probs, k)[1], e)  # [T, k, E]
    want = e * jnp.sum(jnp.mean(hits, 0) * jnp.mean(probs, 0)[None])
    aux, z = moe.router_loss_values(cfg, logits)
    np.testing.assert_allclose(aux, want, rtol=1e-6)
    np.testing.assert_allclose(z, jnp.mean(jax.nn.logsumexp(logits, -1) ** 2), rtol=1e-6)


def _kept_by_hand(ids, rows, c):
    """ids [rows s, k] -> whether each copy fits its expert's c slots of its sequence:
    a loop over the copies in token order with a counter per (sequence, expert)."""
    ids = np.asarray(ids).reshape(rows, -1, ids.shape[-1])
    kept = np.zeros(ids.shape, bool)
    for r in range(rows):
        used = {}
        for t in range(ids.shape[1]):
            for j in range(ids.shape[2]):
                e = int(ids[r, t, j])
                kept[r, t, j] = used.get(e, 0) < c
                used[e] = used.get(e, 0) + 1
    return kept.reshape(-1, ids.shape[-1])


def test_capacity_slots_drop_the_copies_past_c_in_token_order():
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, capacity_factor=0.7))
    ids = jax.random.randint(jax.random.key(3), (3 * 8, 2), 0, 5)
    ids = ids.at[:, 1].set((ids[:, 0] + 1 + ids[:, 1] % 4) % 5)  # two distinct experts
    c = moe_slots.capacity(cfg, 8)
    assert c == 3  # ceil(0.7 x 8 x 2 / 5)
    slot, got_c = moe_slots.slots(cfg, ids, 3)
    kept = _kept_by_hand(ids, 3, c)
    assert got_c == c and 0 < (~kept).sum() < kept.size
    np.testing.assert_array_equal(np.asarray(slot) < 3 * c, kept)
    assert len({(int(e), int(s)) for e, s in zip(ids[kept], slot[kept])}) == kept.sum()
    assert float(moe_slots.dropped_copies(cfg, ids, 3)) == (~kept).sum()


@pytest.mark.parametrize("factor", [0.6, 2.5])  # 2.5 = E / k: every slot there, none dropped
def test_capacity_experts_equal_the_dense_reference_forward_and_backward(factor):
    """The static slots (batched einsums) against every expert on every token with the
    dropped copies' weights zero, kept copies found by hand; with room for every copy
    equal to the dropless grouped path."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, capacity_factor=factor))
    x, variables = setup(cfg)
    r = jax.random.normal(jax.random.key(2), x.shape)

    def loss(v, x, dense, c=cfg):
        return jnp.sum(moe.MoE(c, dense=dense).apply(v, x) * r)

    slotted = jax.value_and_grad(loss, (0, 1))(variables, x, False)
    dense = jax.value_and_grad(loss, (0, 1))(variables, x, True)
    np.testing.assert_allclose(slotted[0], dense[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(slotted[1]), jax.tree.leaves(dense[1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))
    logits = (x @ variables["params"]["router"]).reshape(-1, cfg.moe.experts)
    weights, ids = moe.route(cfg, logits)
    kept = _kept_by_hand(ids, x.shape[0], moe_slots.capacity(cfg, x.shape[1]))
    by_hand = moe.dense_moe(CFG, x.reshape(-1, cfg.d_model), jnp.where(kept, weights, 0.0),
                            ids, variables["params"]["w_gate_up"], variables["params"]["w_down"])
    np.testing.assert_allclose(jnp.sum(by_hand.reshape(x.shape) * r), slotted[0], rtol=1e-5)
    dropless = loss(variables, x, False, CFG)
    assert np.isclose(dropless, slotted[0], rtol=1e-5) == kept.all()


@pytest.mark.parametrize("change,message", [
    (dict(top_k=6), "model.moe.top_k=6 must be in [1, model.moe.experts=5]"),
    (dict(top_k=0), "model.moe.top_k=0 must be in [1"),
    (dict(experts=-1), "model.moe.experts=-1 must be >= 1"),
    (dict(aux_loss_coef=-1.0), "model.moe.aux_loss_coef=-1.0 must be >= 0"),
    (dict(every=2), "model.moe.every=2 must be >= 1 and divide model.n_layers - "
                    "model.moe.first_dense=1"),
    (dict(every=0), "model.moe.every=0 must be >= 1"),
    (dict(first_dense=1), "model.moe.first_dense=1 must be in [0, model.n_layers=1)"),
    (dict(shared_experts=-1), "model.moe.shared_experts=-1 must be >= 0"),
    (dict(shared_experts=1, shared_hidden=0), "model.moe.shared_hidden=0 must be >= 1"),
    (dict(shared_gate=True), "need shared experts (model.moe.shared_experts >= 1)"),
    (dict(router="topk"), "model.moe.router='topk' is not one of softmax, sigmoid"),
    (dict(routed_scale=0.0), "model.moe.routed_scale=0.0 must be > 0"),
    (dict(capacity_factor=0.0), "model.moe.capacity_factor=0.0 must be > 0 (null: dropless)"),
])
def test_bad_moe_settings_are_one_line_each(change, message):
    errs = check_model(dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, **change)))
    assert len(errs) == 1 and message in errs[0] and "\n" not in errs[0], errs


def test_a_moe_family_needs_experts():
    errs = check_model(dataclasses.replace(CFG, family="mixtral", moe=MoeConfig()))
    assert errs == ["model.moe.experts=0 must be >= 1 (model.family=mixtral is a mixture "
                    "of experts)"]
    assert check_model(dataclasses.replace(CFG, family="qwen3_moe")) == []


def test_moe_settings_on_a_dense_model_are_refused_not_ignored():
    dense = dataclasses.replace(CFG, n_layers=4, moe=MoeConfig(every=2, first_dense=1))
    assert check_model(dense) == [
        "model.moe.every=2, first_dense=1 set on a dense model (model.moe.experts=0): set "
        "model.moe.experts >= 1 for a mixture of experts, or leave them unset"]
    assert check_model(dataclasses.replace(dense, moe=MoeConfig())) == []


def test_moe_settings_through_hydra_and_the_layout_check():
    """`model.moe.*` from the command line; the layout check (framework/engine/validate.py)
    refuses a bad one in one line before anything is compiled."""
    from framework.config import ParallelConfig, TrainConfig
    from framework.engine.validate import check
    from tests.helpers import compose_recipe

    cfg = compose_recipe("llama_tiny_debug", "model.family=mixtral", "model.moe.experts=4",
                         "model.moe.top_k=5")
    assert cfg.model.moe == MoeConfig(experts=4, top_k=5)
    errs = check(cfg.model, ParallelConfig(), TrainConfig(seq_len=8, global_batch_size=8), 1)
    assert errs == ["model.moe.top_k=5 must be in [1, model.moe.experts=4]"]
    cfg = compose_recipe("llama_tiny_debug", "model.moe.experts=4", "model.moe.router=sigmoid",
                         "model.moe.routed_scale=2.5", "model.moe.shared_experts=1",
                         "model.moe.shared_hidden=32", "model.moe.shared_gate=true")
    assert cfg.model.moe == MoeConfig(experts=4, router="sigmoid", routed_scale=2.5,
                                      shared_experts=1, shared_hidden=32, shared_gate=True)


def test_parameter_count_and_flops_count_the_experts():
    """count_params: every leaf (all experts and the router); the FLOPs' 6N: the
    parameters one token uses (its top_k experts and the router)."""
    from framework.model import flops
    from framework.model.llama import count_params, init_params

    cfg = dataclasses.replace(CFG, n_layers=2)
    leaves = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    assert count_params(cfg) == sum(x.size for x in jax.tree.leaves(leaves))
    idle = (cfg.moe.experts - cfg.moe.top_k) * 3 * cfg.d_model * 24 * cfg.n_layers
    assert count_params(cfg, active=True) == count_params(cfg) - idle
    embedding = cfg.vocab_size * cfg.d_model
    assert flops.matmul_params(cfg) == count_params(cfg) - idle - embedding
    # the shared expert (two experts wide, 3 d 48) and its gate (d): every token's
    shared = dataclasses.replace(SHARED, n_layers=2)
    leaves = jax.eval_shape(lambda: init_params(shared, jax.random.key(0)))
    assert count_params(shared) == sum(x.size for x in jax.tree.leaves(leaves))
    assert count_params(shared, active=True) == count_params(cfg, active=True) + 2 * (
        3 * cfg.d_model * 48 + cfg.d_model)
    assert flops.matmul_params(shared) == flops.matmul_params(cfg) + 2 * (
        3 * cfg.d_model * 48 + cfg.d_model)


def test_moe_config_json_reads_and_refuses_in_one_line():
    """Qwen3-MoE and Mixtral config.json (the committed fixtures) -> model.moe; a feature
    this model does not run is named in one line (framework/io/hf/moe.py). Qwen2-MoE's:
    tests/unit/test_hf_qwen2_moe.py."""
    from framework.errors import ConfigError
    from framework.io.hf import family
    from tests.helpers import FIXTURES

    qwen = family.read_config(FIXTURES / "hf" / "qwen3_moe")
    mixtral = family.read_config(FIXTURES / "hf" / "mixtral")
    assert family.model_config(qwen).moe == MoeConfig(experts=4, top_k=2, expert_hidden=24,
                                                      renormalize=False)
    assert family.model_config(mixtral).moe == MoeConfig(experts=4, top_k=2, expert_hidden=48)
    published = {k: v for k, v in qwen.items() if k != "num_local_experts"}
    assert family.model_config({**published, "num_experts": 128}).moe.experts == 128
    assert family.model_config({**qwen, "mlp_only_layers": [1, 0]}).moe.first_dense == 2
    with_logits = {**mixtral, "output_router_logits": True}
    assert family.model_config(with_logits).moe.aux_loss_coef == 0.02
    # MoE every 2nd layer of 2 (layer 1: (i + 1) % 2 == 0)
    assert family.model_config({**qwen, "decoder_sparse_step": 2}).moe.every == 2
    # layer 0 dense by mlp_only_layers and by the step alike: a unit of (dense, MoE)
    both = family.model_config({**qwen, "decoder_sparse_step": 2, "mlp_only_layers": [0]})
    assert (both.moe.first_dense, both.moe.every) == (0, 2)
    refused = {"decoder_sparse_step=3 with 2 layers after the first 0 is not supported": {
                   **qwen, "decoder_sparse_step": 3},
               "mlp_only_layers=[1] is not supported (only the first layers dense": {
                   **qwen, "mlp_only_layers": [1]},
               "router_jitter_noise=0.1 is not supported": {**mixtral,
                                                            "router_jitter_noise": 0.1},
               "num_experts_per_tok=0 is not a whole number": {**mixtral,
                                                               "num_experts_per_tok": 0},
               "model_type 'qwen2_vl'": {**qwen, "model_type": "qwen2_vl"},
               "shared_expert_intermediate_size=64 is not supported": {
                   **qwen, "shared_expert_intermediate_size": 64},
               "n_shared_experts=1 is not supported": {**mixtral, "n_shared_experts": 1},
               "scoring_func='sigmoid' is not supported": {**qwen, "scoring_func": "sigmoid"}}
    for message, config in refused.items():
        with pytest.raises(ConfigError) as err:
            family.model_config(config, "x/config.json")
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    exported = family.export_config(family.model_config(qwen), "float32")
    assert family.model_config(exported) == family.model_config(qwen)
    # shared experts and the sigmoid router: no export, and no start from such a folder
    theirs = family.model_config(qwen)
    mine = dataclasses.replace(theirs.moe, shared_experts=1, router="sigmoid")
    for attempt in (lambda: family.export_config(dataclasses.replace(theirs, moe=mine),
                                                 "float32"),
                    lambda: family.merge_model({"moe": mine}, theirs, "x/config.json")):
        with pytest.raises(ConfigError) as err:
            attempt()
        assert "model.moe.shared_experts=1, model.moe.router=sigmoid: " in str(err.value)
        assert "\n" not in str(err.value)
    assert family.merge_model({"moe": MoeConfig(aux_loss_coef=0.5)}, theirs,
                              "x/config.json").moe.aux_loss_coef == 0.5


def test_a_checkpoints_model_settings_read_back_with_their_experts():
    """Checkpoint metadata holds `dataclasses.asdict(model)`: its `moe` comes back as a
    MoeConfig (it came back a dict, and exporting a MoE run's folder failed)."""
    import dataclasses

    from framework.config import ModelConfig, MoeConfig
    from framework.io.weights import model_config_from_dict
    cfg = ModelConfig(moe=MoeConfig(experts=4, top_k=2))
    assert model_config_from_dict(dataclasses.asdict(cfg)) == cfg
    assert model_config_from_dict(dataclasses.asdict(ModelConfig())) == ModelConfig()


def test_a_capacity_factor_with_context_parallelism_is_refused_in_one_line():
    from framework.config import ParallelConfig, TrainConfig
    from framework.engine.validate import check

    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, capacity_factor=1.25))
    errs = check(cfg, ParallelConfig(context=2), TrainConfig(seq_len=8, global_batch_size=8), 2)
    assert errs == ["model.moe.capacity_factor=1.25 does not run with parallel.context=2 "
                    "(slots are counted over whole sequences): use "
                    "model.moe.capacity_factor=null (dropless) or parallel.context=1"]


def test_starting_from_a_folder_keeps_the_capacity_factor_given():
    """train.init_from: the folder's experts, the training settings given (the loss
    coefficients and the capacity factor; it was silently dropped before 2026-11-29)."""
    from framework.errors import ConfigError
    from framework.io.hf import moe as hf_moe

    folder = dataclasses.replace(CFG, family="mixtral", moe=MoeConfig(experts=4, top_k=2))
    got = hf_moe.merged({"moe": {"capacity_factor": 1.25, "aux_loss_coef": 0.1}}, folder)
    assert got.moe == MoeConfig(experts=4, top_k=2, capacity_factor=1.25, aux_loss_coef=0.1)
    assert hf_moe.merged({"moe": {"experts": 9}}, folder).moe == folder.moe
    # which layers are MoE is the folder's: another given is refused, not dropped
    with pytest.raises(ConfigError, match=r"model.moe.every=2 \(the folder's 1\): "
                                          r"config.json says which layers are MoE"):
        hf_moe.merged({"moe": {"every": 2}}, folder)
    assert hf_moe.merged({"moe": {"every": 1, "first_dense": 0}}, folder).moe == folder.moe
    # a dense folder: MoE settings given are refused, not dropped
    dense = dataclasses.replace(CFG, moe=MoeConfig())
    with pytest.raises(ConfigError, match=r"^model.moe.experts=8, model.moe.top_k=1: "
                                          r"config.json is a dense model \(no experts\)"):
        hf_moe.merged({"moe": {"experts": 8, "top_k": 1, "every": 1}}, dense)
    assert hf_moe.merged({"moe": {"experts": 0, "top_k": 2}}, dense) is dense


def test_expert_chunks_below_one_is_refused_in_one_line():
    from framework.config import ParallelConfig, TrainConfig
    from framework.engine.validate import check

    errs = check(CFG, ParallelConfig(expert_chunks=0), TrainConfig(seq_len=8,
                                                                   global_batch_size=8), 1)
    assert errs == ["parallel.expert_chunks=0 must be >= 1 (1: the slots exchanged at once)"]
