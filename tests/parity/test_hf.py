"""Hugging Face folders (Llama, Qwen2, Qwen3, Mistral): logits parity with transformers
on one device and on (2, 2, 2) with 1F1B, config.json mapping and its errors,
bit-exact import -> export (and import -> train -> export), and what a process reads
of a sharded import.

The fixtures (tests/fixtures/hf/, written once by tools/make_hf_fixtures.py with
transformers; see its docstring) hold tiny GQA models and transformers' own float32
logits for fixed ids: Llamas tied + plain RoPE, untied + plain RoPE (legacy
`rope_theta` key), untied + Llama 3 RoPE scaling in bfloat16 across three safetensors
files; Qwen2 (q/k/v biases, tied), Qwen3 (q/k norm, head_dim 16 = 2 x hidden/heads),
Mistral (untied), Gemma 2, and the mixtures of experts Qwen3-MoE (top 2 of 4 experts,
not renormalised), Mixtral (top 2 of 4, renormalised), Qwen2-MoE (q/k/v biases, top 2
of 4 not renormalised, a sigmoid-gated shared expert) and Qwen3-MoE with a dense layer
first (mlp_only_layers [0]).
"""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from framework.io.hf import llama as hf
from framework.model import reference
from framework.errors import ConfigError
from framework.config import ModelConfig, MoeConfig, RopeScaling, TrainConfig
from framework.io.hf.safetensors import Tensors
from tests.helpers import canonical_of, FIXTURES, compose_recipe, engine, max_rel_err, worst

HF = FIXTURES / "hf"
FAMILIES = ("qwen2_tied", "qwen3_head_dim", "mistral_untied", "mistral_window",
            "gemma2_window_softcap", "qwen3_moe", "mixtral", "qwen2_moe",
            "qwen3_moe_dense_first", "qwen3_moe_sparse_step")
NAMES = ("tied_gqa", "untied_gqa", "llama3_bf16_sharded") + FAMILIES


def single_device(cfg: ModelConfig):
    # Auto, as the framework's meshes (framework/parallel/mesh.py): on an Explicit mesh
    # jax 0.10.2 cannot infer ragged_dot's output sharding (the experts' matmuls)
    mesh = jax.make_mesh((1,), ("one",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), hf.canonical_shapes(cfg))


def load(name: str, shardings=None):
    folder = HF / name  # (an absolute path stays itself)
    cfg = hf.model_config(hf.read_config(folder))
    return cfg, hf.load_params(folder, cfg, shardings or single_device(cfg))


def rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
    cfg, params = load(name)
    ids, want = np.load(HF / name / "ids.npy"), np.load(HF / name / "logits.npy")
    forward = lambda c: jax.jit(lambda p, i: reference.forward(p, i, c))(params, ids)
    assert rel(forward(cfg), want) <= 1e-5
    if name == "llama3_bf16_sharded":  # the scaling is what makes it match
        assert cfg.rope_scaling.rope_type == "llama3"
        assert rel(forward(dataclasses.replace(cfg, rope_scaling=RopeScaling())), want) > 0.1
    for change in WHAT_MATTERS.get(name, ()):  # the window, the pattern, each soft-cap
        assert rel(forward(dataclasses.replace(cfg, **change)), want) > 1e-3, change


WHAT_MATTERS = {
    "mistral_window": [dict(sliding_window=None)],
    "qwen2_moe": [dict(moe=MoeConfig(experts=4, top_k=2, expert_hidden=24, renormalize=False,
                                     shared_experts=1, shared_hidden=40))],  # ungated
    "gemma2_window_softcap": [dict(sliding_window=None), dict(sliding_window_pattern=0),
                              dict(attn_softcap=None), dict(final_softcap=None),
                              dict(query_pre_attn_scalar=None)],
}


def test_both_rope_spellings_and_the_llama_1b_group():
    """`rope_theta` + `rope_scaling` (published Llama 3 folders) and `rope_parameters`
    (newer transformers) give the same model; conf/model/llama_1b.yaml is exactly what
    Llama-3.2-1B's config.json maps to."""
    new = hf.read_config(HF / "llama3_bf16_sharded")
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    params = dict(new["rope_parameters"])
    legacy["rope_theta"] = params.pop("rope_theta")
    legacy["rope_scaling"] = params
    assert hf.model_config(new) == hf.model_config(legacy)
    llama_3_2_1b = {  # meta-llama/Llama-3.2-1B config.json (shape keys)
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True, "max_position_embeddings": 131072}
    group = compose_recipe("llama_1b_8gpu").model  # with its loss in chunks (not the model)
    assert hf.model_config(llama_3_2_1b, dtype=group.dtype) == dataclasses.replace(
        group, loss_chunk=0)


def test_config_json_errors_are_one_line(tmp_path):
    cfg = hf.model_config(hf.read_config(HF / "tied_gqa"))
    with pytest.raises(ConfigError) as err:
        hf.merge_model({"d_model": 64, "n_layers": 2, "dtype": "bfloat16"}, cfg, "x/config.json")
    assert str(err.value).startswith("model.d_model=64 but x/config.json has hidden_size=32")
    assert "\n" not in str(err.value)
    merged = hf.merge_model({"n_layers": 2, "dtype": "bfloat16", "loss_chunk": 64}, cfg,
                            "x/config.json")  # the loss's chunk: the run's, kept
    assert merged == dataclasses.replace(cfg, dtype="bfloat16", loss_chunk=64)
    bad = {**hf.read_config(HF / "tied_gqa"), "rope_parameters": {"rope_type": "yarn"}}
    with pytest.raises(ConfigError, match="rope_type 'yarn' is not supported"):
        hf.model_config(bad)
    # A truncated safetensors file and a missing tensor.
    folder = tmp_path / "damaged"
    shutil.copytree(HF / "tied_gqa", folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError, match="truncated or damaged"):
        Tensors(folder)
    untied = dataclasses.replace(cfg, tie_embeddings=False)
    with pytest.raises(ConfigError, match="lm_head.weight is missing"):
        hf.check_tensors(Tensors(HF / "tied_gqa"), untied, "tied_gqa")


@pytest.mark.parametrize("name,dtype", [("llama3_bf16_sharded", "bfloat16"),
                                        ("tied_gqa", "float32")]
                         + [(name, "float32") for name in FAMILIES])
def test_import_then_export_is_bit_exact(name, dtype, tmp_path):
    """Imported onto a (2, 2, 2) layout's shardings, exported, read back: the same
    tensors, bit for bit (and sharded like the original past a size limit)."""
    cfg = hf.model_config(hf.read_config(HF / name))
    eng = engine(2, 2, 2, 2, model=cfg, train=TrainConfig(seq_len=8, global_batch_size=8))
    params = hf.load_params(HF / name, cfg, eng.layout.canonical_shardings["params"])
    files = hf.export(tmp_path, cfg, params, dtype, hf.read_config(HF / name),
                      max_shard_bytes=14_000)
    original, exported = Tensors(HF / name), Tensors(tmp_path)
    assert sorted(original.where) == sorted(exported.where)
    for tensor in original.where:
        a, b = original.read(tensor), exported.read(tensor)
        assert a.dtype == b.dtype and a.shape == b.shape, tensor
        assert a.tobytes() == b.tobytes(), tensor
    assert len(files) > 3 and "model.safetensors.index.json" in files
    assert hf.model_config(hf.read_config(tmp_path)) == cfg


def test_a_process_reads_only_the_blocks_its_devices_hold():
    """The bound: a process reads exactly the distinct blocks of each leaf that its own
    devices hold (devices replicating a block, e.g. over `data`, share one read). Counted
    as bytes copied out of the memory-mapped files. Here two would-be processes of a
    (2, 2, 2) mesh: the 4 devices of pipeline stage 0 read everything but layer 1; the 4
    devices of tensor rank 0 read half of every tensor-sharded weight plus the norms."""
    name = "llama3_bf16_sharded"
    cfg = hf.model_config(hf.read_config(HF / name))
    eng = engine(2, 2, 2, 2, model=cfg, train=TrainConfig(seq_len=8, global_batch_size=8))
    shardings = eng.layout.canonical_shardings["params"]
    shapes = hf.canonical_shapes(cfg)
    mesh = eng.mesh
    sizes = {n: int(np.prod(s)) * 2 for n, s in hf.expected_tensors(cfg).items()}  # bf16
    total = sum(sizes.values())

    def bytes_read(devices) -> int:
        tensors = Tensors(HF / name)
        readers = hf.leaf_readers(tensors, cfg)
        for path, shape in jax.tree_util.tree_flatten_with_path(shapes)[0]:
            key = tuple(k.key for k in path)
            hf.read_shards(readers[key], shape.shape, _get(shardings, key), devices)
        return tensors.bytes_read

    stage0 = list(mesh.devices[0].flat)
    layer1 = sum(n for k, n in sizes.items() if k.startswith("model.layers.1."))
    assert bytes_read(stage0) == total - layer1
    tensor0 = list(mesh.devices[..., 0].flat)
    norms = sum(n for k, n in sizes.items() if "norm" in k)
    assert bytes_read(tensor0) == (total - norms) // 2 + norms
    assert bytes_read(list(mesh.devices.flat)) == total  # the whole mesh: each byte once


def _get(tree, key):
    for k in key:
        tree = tree[k]
    return tree


def test_exported_config_is_what_transformers_reads():
    cfg = hf.model_config(hf.read_config(HF / "llama3_bf16_sharded"))
    out = hf.export_config(cfg, "bfloat16", None, max_positions=256)
    assert out["rope_scaling"]["rope_type"] == "llama3" and out["head_dim"] == 8
    assert out["max_position_embeddings"] == 256 and out["torch_dtype"] == "bfloat16"
    assert hf.model_config(json.loads(json.dumps(out))) == cfg


def fixture_batch(name: str):
    """The fixture's ids as a training batch of 8 rows (its 2 rows, 4 times: the mean
    loss is theirs) and the mean cross-entropy of transformers' logits on them."""
    ids, logits = np.load(HF / name / "ids.npy"), np.load(HF / name / "logits.npy")
    shifted = logits[:, :-1] - logits[:, :-1].max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()
    return np.tile(ids, (4, 1)), float(nll)


# The families whose settings differ most (mixtures of experts, one with a gated shared
# expert, one with dense layers first and MoE every 2nd layer after them, whose writer
# covers `qwen3_moe_dense_first`'s mlp_only_layers and plain `qwen3_moe`'s MoE layers
# too; Gemma 2's window, softcaps and norms; Qwen2's biases and tied embeddings): every
# family's own settings are exact on every path in tests/parity/test_families.py and
# drawn by the search.
TRAINED = ("qwen2_moe", "gemma2_window_softcap", "qwen2_tied", "qwen3_moe_sparse_step")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in TRAINED])
def test_families_on_pp2_dp2_tp2_1f1b_then_train_and_export_unchanged(name, tmp_path):
    """On (2, 2, 2) with 1F1B: the loss of the fixture's ids is the cross-entropy of
    transformers' logits (1e-5) and every gradient the single-device one of the same
    weights (1e-4); then two AdamW steps there (the first at warm-up's learning rate
    0), export, import: the trained weights, bit for bit, under the same family."""
    cfg = hf.model_config(hf.read_config(HF / name))
    batch, want = fixture_batch(name)
    train = TrainConfig(seq_len=batch.shape[1] - 1, global_batch_size=8)
    eng = engine(2, 2, 2, 4, model=cfg, train=train, schedule="1f1b")
    params = hf.load_params(HF / name, cfg, eng.layout.canonical_shardings["params"])
    loss, grads = eng.loss_and_grads_fn()(eng.shard_params(params), eng.shard_batch(batch))
    assert abs(float(loss) - want) <= 1e-5 * want
    ref_loss, ref_grads = jax.jit(lambda p, t: reference.loss_and_grads(p, t, cfg))(
        load(name)[1], batch)
    assert worst(max_rel_err(canonical_of(eng, grads), ref_grads)) <= 1e-4
    state = eng.init_state(params)
    for _ in range(2):
        state, _ = eng.step(state, eng.shard_batch(batch))
    trained = jax.device_get(canonical_of(eng, state["params"]))
    hf.export(tmp_path, cfg, trained, "float32", hf.read_config(HF / name))
    exported = hf.read_config(tmp_path)
    assert exported["model_type"] == cfg.family and hf.model_config(exported) == cfg
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 2
    back = jax.device_get(load(str(tmp_path))[1])
    same = jax.tree.map(lambda a, b: a.tobytes() == b.tobytes(), back, trained)
    assert all(jax.tree.leaves(same)), same
    assert not np.array_equal(trained["embed"]["table"], jax.device_get(params["embed"]["table"]))


def test_unsupported_architectures_and_fields_are_one_line(tmp_path, capsys):
    """Each refusal names the field or architecture, on one line: another model_type,
    a sliding window that cuts attention short, Qwen3's attention_bias; the export of
    settings the family cannot hold; the command lines exit with status 2."""
    mistral, qwen2 = hf.read_config(HF / "mistral_untied"), hf.read_config(HF / "qwen2_tied")
    gemma2 = hf.read_config(HF / "gemma2_window_softcap")
    refused = {
        "model_type 'gemma' / architectures ['GemmaForCausalLM'] is not supported":
            {**mistral, "model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
        "layer_types ['sliding_attention', 'full_attention', 'full_attention', "
        "'sliding_attention'] is not supported": {**gemma2, "layer_types": [
            "sliding_attention", "full_attention", "full_attention", "sliding_attention"]},
        "hidden_activation='gelu' is not supported (only 'gelu_pytorch_tanh')":
            {**gemma2, "hidden_activation": "gelu"},
        "layer_types holds 'sliding_attention'":
            {**qwen2, "layer_types": ["full_attention", "sliding_attention"]},
        "sliding_window=32 (below": {**qwen2, "layer_types": None, "use_sliding_window": True,
                                     "sliding_window": 32, "max_window_layers": 1},
        "attention_bias=True is not supported": {
            **hf.read_config(HF / "qwen3_head_dim"), "attention_bias": True},
    }
    for message, config in refused.items():
        with pytest.raises(ConfigError) as err:
            hf.model_config(config, "x/config.json")
        assert message in str(err.value) and "\n" not in str(err.value)
    # Mistral's window is on every layer; Gemma 2's layer_types a pattern (absent:
    # transformers' default, every other layer); Qwen's window switched off cuts nothing.
    assert hf.model_config({**mistral, "sliding_window": 64}).sliding_window == 64
    plain = {k: v for k, v in gemma2.items() if k != "layer_types"}
    assert hf.model_config(plain).sliding_window_pattern == 2
    every = {**gemma2, "layer_types": ["sliding_attention"] * 4}
    assert hf.model_config(every).sliding_window_pattern == 0
    assert hf.model_config({**qwen2, "use_sliding_window": True, "sliding_window": 32,
                            "max_window_layers": 2}).has_qkv_bias
    folder_cfg = hf.model_config(qwen2)
    with pytest.raises(ConfigError, match=r"model.qk_norm=True but x has model_type=qwen2 "
                                          r"\(so qk_norm=False\)"):
        hf.merge_model({"qk_norm": True, "family": "qwen2"}, folder_cfg, "x")
    llama_with_bias = dataclasses.replace(folder_cfg, family="llama", qkv_bias=True)
    with pytest.raises(ConfigError, match="model.qkv_bias=True cannot be written as a llama "
                                          ".*: export it as model.family=qwen2"):
        hf.export(tmp_path / "out", llama_with_bias, load("qwen2_tied")[1])
    assert not (tmp_path / "out").exists()  # refused before writing anything
    windowed_llama = dataclasses.replace(hf.model_config(mistral), family="llama",
                                         sliding_window=64)
    with pytest.raises(ConfigError, match="model.sliding_window=64 cannot be written as a "
                                          "llama .LlamaForCausalLM. folder"):
        hf.export_config(windowed_llama, "float32")
    gemma = tmp_path / "gemma"
    shutil.copytree(HF / "mistral_untied", gemma)
    (gemma / "config.json").write_text(json.dumps({**mistral, "model_type": "gemma"}))
    from tests.helpers import load_tool
    assert load_tool("export_hf").main([str(gemma), str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "model_type 'gemma'" in err and "\n" not in err
