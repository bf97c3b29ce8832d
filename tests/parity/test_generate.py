"""Decoding: the KV cache against recomputing the full forward (one device and tensor
parallel), transformers' own greedy continuation (a Llama, and each model family),
seeded sampling, the command line."""


import jax
import numpy as np
import pytest

from framework.engine import decode
from framework.run import generate
from framework.io.hf import llama as hf
from framework.model import reference
from framework.errors import ConfigError
from framework.config import ParallelConfig
from framework.parallel.mesh import make_mesh
from tests.helpers import FIXTURES

FIXTURE = FIXTURES / "hf" / "llama3_bf16_sharded"
N_NEW = 32


@pytest.fixture(scope="module")
def model():
    cfg = hf.model_config(hf.read_config(FIXTURE))
    prompt = np.load(FIXTURE / "ids.npy")[:1, :4]
    return cfg, prompt


def decoder(cfg, tensor: int):
    dec = decode.Decoder(cfg, make_mesh(ParallelConfig(tensor=tensor)))
    return dec, hf.load_params(FIXTURE, cfg, dec.param_shardings)


@pytest.fixture(scope="module")
def recomputed(model):
    """Greedy by the full forward at every step, and the smallest gap between the two
    best logits along the way (the test means something only if it is not ~0)."""
    cfg, prompt = model
    dec, params = decoder(cfg, 1)
    ids = decode.greedy_by_recompute(cfg, params, prompt, N_NEW)
    full = np.concatenate([prompt, ids], axis=1)
    logits = np.asarray(jax.jit(lambda p, t: reference.forward(p, t, cfg))(params, full))
    top2 = np.sort(logits[0, prompt.shape[1] - 1:-1], axis=-1)[:, -2:]
    return ids, float(np.min(top2[:, 1] - top2[:, 0]))


@pytest.mark.parametrize("tensor", [1, 2])
def test_kv_cache_greedy_equals_recomputing_the_full_forward(model, recomputed, tensor):
    cfg, prompt = model
    ids, gap = recomputed
    assert gap > 1e-4  # no near-ties: float rounding cannot decide a token
    dec, params = decoder(cfg, tensor)
    cached = dec.generate(params, prompt, N_NEW)
    np.testing.assert_array_equal(cached, ids)
    # ... and transformers' own greedy continuation (its generate with a cache).
    np.testing.assert_array_equal(cached[0, :16], np.load(FIXTURE / "greedy.npy"))


def test_sampling_is_reproducible_per_seed_and_top_k_1_is_greedy(model, recomputed):
    cfg, prompt = model
    dec, params = decoder(cfg, 2)
    run = lambda seed, **kw: dec.generate(params, prompt, N_NEW,
                                          decode.Sampling(seed=seed, **kw))
    settings = dict(temperature=0.8, top_k=50, top_p=0.95)
    first = run(0, **settings)
    np.testing.assert_array_equal(first, run(0, **settings))
    assert not np.array_equal(first, run(1, **settings))
    np.testing.assert_array_equal(run(5, temperature=1.0, top_k=1), recomputed[0])
    np.testing.assert_array_equal(run(5, temperature=1.0, top_p=1e-6), recomputed[0])
    # Stops once every row produced an end-of-sequence id.
    eos = int(recomputed[0][0, 3])
    assert dec.generate(params, prompt, N_NEW, eos_ids=(eos,)).shape == (1, 4)


def test_nucleus_keeps_the_smallest_set_holding_top_p():
    logits = np.tile(np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)), (400, 1))
    draw = lambda k, p: set(np.asarray(
        decode.sample(logits, jax.random.key(0), 1.0, k, p)).tolist())
    assert draw(0, 0.7) == {0, 1}  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops
    assert draw(3, 1.0) == {0, 1, 2}
    assert draw(3, 0.9) == {0, 1, 2}  # top_p over the renormalised top 3
    assert draw(0, 1.0) == {0, 1, 2, 3}


def test_bad_settings_are_one_line_errors():
    for argv, match in ((["prompt=hi"], "checkpoint=.* is required"),
                        ([f"checkpoint={FIXTURE}", "top_p=2"], "top_p=2.0 must be in"),
                        ([f"checkpoint={FIXTURE}", "temprature=1"], "unknown setting 'temprature'"),
                        ([f"checkpoint={FIXTURE}", "tensor=two"],
                         "tensor='two' is not a valid int")):
        with pytest.raises(ConfigError, match=match) as err:
            generate.parse_args(argv)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no tokenizer is known"):
        generate.run(generate.parse_args([f"checkpoint={FIXTURE}", "prompt=hi"]),
                     devices=jax.devices())
    with pytest.raises(ConfigError, match="n_kv_heads=2 is not divisible by tensor=4"):
        generate.run(generate.parse_args([f"checkpoint={FIXTURE}", "prompt_ids=1", "tensor=4"]),
                     devices=jax.devices())


@pytest.mark.parametrize("arg, want", [
    ("seed=4294967296", "seed=4294967296 must be in [0, 4294967295] (a uint32)"),
    ("seed=-1", "seed=-1 must be in [0, 4294967295] (a uint32)"),
    ("temperature=inf", "temperature=inf must be in [0, 100] (0: greedy; higher is uniform "
                        "sampling)"),
    ("temperature=nan", "temperature=nan must be in [0, 100] (0: greedy; higher is uniform "
                        "sampling)"),
    ("top_k=2147483648", "top_k=2147483648 must be in [0, 2147483647] (0: off)"),
    ("step=-1", "step=-1 must be >= 0")])
def test_settings_outside_what_decoding_takes_are_one_line_errors(arg, want):
    """Each was a traceback (OverflowError) or accepted silently (temperature=inf)."""
    with pytest.raises(ConfigError) as err:
        generate.parse_args([f"checkpoint={FIXTURE}", "prompt_ids=1", arg])
    assert str(err.value) == want
    generate.parse_args([f"checkpoint={FIXTURE}", "seed=4294967295", "top_k=2147483647"])


def test_prompt_and_continuation_must_fit_the_models_positions(monkeypatch):
    """The fixture's config.json has max_position_embeddings 128: the KV cache of a huge
    max_new_tokens (an out-of-memory traceback before) and a longer prompt (accepted
    silently before) are refused before the weights are read or anything compiles."""
    generate.check_length(100, 28, 128, "here")  # exactly full
    with pytest.raises(ConfigError, match=r"^max_new_tokens=29 after a 100-token prompt needs "
                                          r"129 positions but the model has 128 \(here\): "
                                          r"max_new_tokens must be <= 28$"):
        generate.check_length(100, 29, 128, "here")
    from framework.io import weights
    monkeypatch.setattr(weights.Source, "load", lambda *_: pytest.fail("the weights were read"))
    origin = r"\(max_position_embeddings in its config.json\)"
    for args, match in ((["prompt_ids=1,2,3", "max_new_tokens=100000000000"],
                         f"needs 100000000003 positions but the model has 128 {origin}: "
                         f"max_new_tokens must be <= 125"),
                        (["prompt_ids=" + ",".join(["1"] * 128), "max_new_tokens=1"],
                         f"^the prompt is 128 tokens but the model has 128 positions {origin}: "
                         f"give at most 127")):
        with pytest.raises(ConfigError, match=match):
            generate.run(generate.parse_args([f"checkpoint={FIXTURE}", *args]),
                         devices=jax.devices())


@pytest.mark.parametrize("name", [  # the fast tier: the one most apart from Llama
    pytest.param("qwen2_tied", marks=pytest.mark.slow),
    pytest.param("qwen3_head_dim", marks=pytest.mark.slow),
    pytest.param("mistral_untied", marks=pytest.mark.slow),
    pytest.param("mistral_window", marks=pytest.mark.slow), "gemma2_window_softcap",
    pytest.param("qwen3_moe", marks=pytest.mark.slow),
    pytest.param("mixtral", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", marks=pytest.mark.slow),
    pytest.param("qwen3_moe_dense_first", marks=pytest.mark.slow),
    pytest.param("qwen3_moe_sparse_step", marks=pytest.mark.slow)])
def test_families_kv_cache_greedy_is_transformers_greedy(name):
    """Each family's fixture (q/k/v biases, q/k norm with head_dim 16, Mistral, Mistral
    with a window of 5, Gemma 2 with a window of 5 on every other layer and soft-caps,
    the mixtures of experts Qwen3-MoE, Mixtral, Qwen2-MoE with its gated shared expert
    and Qwen3-MoE with a dense layer first, and with MoE every 2nd layer):
    greedy decoding with the KV cache, on one device and at tensor=2, is transformers'
    own greedy continuation, and the full forward's; no near-tie decides a token. The
    prompt and continuation (20 tokens) outrun the windows: the cache's keys older than
    a window are masked."""
    folder = FIXTURES / "hf" / name
    cfg = hf.model_config(hf.read_config(folder))
    prompt, want = np.load(folder / "ids.npy")[:1, :4], np.load(folder / "greedy.npy")
    for tensor in (1, 2):
        dec = decode.Decoder(cfg, make_mesh(ParallelConfig(tensor=tensor)))
        params = hf.load_params(folder, cfg, dec.param_shardings)
        np.testing.assert_array_equal(dec.generate(params, prompt, len(want))[0], want)
    full = np.concatenate([prompt, want[None]], axis=1)
    logits = np.asarray(jax.jit(lambda p, t: reference.forward(p, t, cfg))(params, full))
    top2 = np.sort(logits[0, prompt.shape[1] - 1:-1], axis=-1)[:, -2:]
    assert np.array_equal(np.argmax(logits[0, prompt.shape[1] - 1:-1], -1), want)
    assert np.min(top2[:, 1] - top2[:, 0]) > 1e-4


def test_a_decode_step_writes_only_the_new_positions_of_the_cache(model):
    """The cache rides the layer loop as its carry (framework/model/stack.py's
    `apply_layers_cached`): a step's compiled program writes the new token's keys and
    values into it, not every layer's rows again (traffic.py's bytes written by dynamic
    updates; 2026-11-29, a 6-layer model with a 12 MiB cache on CPU: 12.0 MiB a token
    written back as scanned outputs, 0.02 MiB in the carry, and 49 -> 31 MiB copied)."""
    from framework.analysis.traffic import moved_bytes

    cfg, prompt = model
    dec, params = decoder(cfg, 1)
    cache = dec.init_cache(2, 256)
    args = (params, np.zeros((2, 1), np.int32), np.int32(5), cache, np.uint32(0),
            np.int32(0), (np.float32(0), np.int32(0), np.float32(1)))
    moved = moved_bytes(dec._step.lower(*args).compile().as_text())
    cache_bytes = sum(a.nbytes for a in jax.tree.leaves(cache))
    new_bytes = cache_bytes / 256  # one position of every layer
    assert moved["updated"] <= 4 * new_bytes, (moved, cache_bytes)
