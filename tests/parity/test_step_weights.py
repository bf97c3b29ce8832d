"""The tick executor's weights made once a step (framework/engine/step_weights.py): a
bfloat16-compute model with float32 parameters gets the same loss and gradients with
its matrices cast once before the tick loop as with every use casting them, for the
parameters every family has (q/k/v biases and q/k norms, a mixture of experts with a
shared expert and the router's bias, Gemma 2's (1 + w) norms) and the executor's
paths (interleaved chunks, the split backward, the combined F+BW cell); with FP8 the
matrices are quantized once too (tests/parity/test_fp8.py: every layout against one
device)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework.config import MoeConfig, cast_at_use
from framework.engine import step_weights
from framework.model import fp8
from tests.helpers import MODEL, engine, engine_grads, engine_losses, max_rel_err, worst

BF16 = dataclasses.replace(MODEL, dtype="bfloat16")
FAMILY = dataclasses.replace(BF16, qkv_bias=True, qk_norm=True)
MOE = dataclasses.replace(BF16, family="qwen3_moe", moe=MoeConfig(
    experts=4, top_k=2, expert_hidden=32, renormalize=True, shared_experts=1,
    shared_gate=True, router="sigmoid", bias_update_rate=0.001))
# (until 2026-12-01 also Qwen's biases and QK norms on 1F1B with tensor 2 and Gemma 2
# on interleaved stages: the parity search draws the families on every schedule)
CASES = [
    pytest.param(MOE, dict(pipeline=2, data=2, tensor=1, microbatches=2, schedule="1f1b"),
                 marks=pytest.mark.slow),
    pytest.param(BF16, dict(pipeline=2, data=1, tensor=2, microbatches=4, schedule="zb_h1",
                            sequence_parallel=True), marks=pytest.mark.slow),
    pytest.param(BF16, dict(pipeline=2, data=1, tensor=1, microbatches=4, schedule="1f1b",
                            combined_1f1b=True, remat="none"), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("model,layout", CASES,
                         ids=["moe-dp", "zb_h1-sp", "combined-none"])
def test_the_weights_made_once_a_step_change_no_number(model, layout, monkeypatch):
    once = engine_grads(engine(model=model, **layout))
    monkeypatch.setattr(step_weights, "once_a_step", lambda *args, **kw: None)
    per_use = engine_grads(engine(model=model, **layout))
    assert once[0] == per_use[0]
    errors = max_rel_err(once[1], per_use[1])
    if model.moe.enabled:  # the experts' down projection: one bfloat16 rounding apart
        # (ragged_dot's weight gradient is a float32 product cast to bfloat16, which the
        # per-use cast widened back; XLA's excess precision dropped the round trip
        # there, the copy's bfloat16 gradient keeps it: 0.17% measured)
        assert 0 < errors["layers"]["moe"].pop("w_down") <= 2.0 ** -8
    assert worst(errors) == 0.0
    assert all(np.asarray(g).dtype == np.float32 for g in jax.tree.leaves(once[1]))


def test_the_copy_casts_the_matrices_and_keeps_the_rest():
    """What the copy holds: the layers' matrices and the head's in the compute dtype,
    the norm scales and the embedding as stored; the gradients accumulate like the
    stored parameters."""
    eng = engine(2, 1, 1, 2, model=FAMILY, schedule="1f1b")
    p = {"embed": {"table": np.zeros((128, 64), np.float32)},
         "head": {"norm": {"scale": np.zeros(64, np.float32)},
                  "w": np.zeros((64, 128), np.float32)},
         "chunks": {"attn": {"wqkv": np.zeros((1, 4, 64, 4, 4, 8), np.float32),
                             "qkv_bias": np.zeros((1, 4, 4, 4, 8), np.float32),
                             "q_norm": {"scale": np.zeros((1, 4, 8), np.float32)}}}}
    run = step_weights.once_a_step(eng.model, lambda v: v)
    compute, like = run(p)
    dtypes = jax.tree.map(lambda a: str(a.dtype), compute)
    assert dtypes == {"embed": {"table": "float32"},
                      "head": {"norm": {"scale": "float32"}, "w": "bfloat16"},
                      "chunks": {"attn": {"wqkv": "bfloat16", "qkv_bias": "bfloat16",
                                          "q_norm": {"scale": "float32"}}}}
    assert like is p or jax.tree.map(lambda a: a.dtype, like) == jax.tree.map(
        lambda a: a.dtype, p)
    assert not cast_at_use(1) and cast_at_use(2)
    every_split = {"stages": {"attn": {"wqkv": 4, "qkv_bias": None}}}  # FSDP per use
    assert step_weights.once_a_step(eng.model, lambda v: v, every_split) is None


def test_fsdp_per_use_leaves_the_copy_the_fp8_matrices_it_does_not_gather():
    """With FSDP gathering per use, the copy holds only the FP8 matrices FSDP leaves
    whole (here the experts, split over `expert` as many ways as `data`), quantized
    with a scale per layer, their E4M3 values as bits (one byte an element) beside the
    stored matrices, which take the gradient (no accumulator for the bits); the
    gathered matrices and the rest as stored, for the uses' gathers. Without such a
    matrix, or without FP8, no copy."""
    model = dataclasses.replace(MOE, fp8="tensorwise")
    dims = {"stages": {"attn": {"wqkv": 4}, "moe": {"w_gate_up": None, "w_down": None,
                                                    "router": None}}}
    rng = np.random.default_rng(0)
    p = {"embed": {"table": np.zeros((128, 64), np.float32)},
         "chunks": {"attn": {"wqkv": rng.normal(size=(1, 2, 64, 12, 8)).astype(np.float32)},
                    "moe": {"w_gate_up": rng.normal(size=(1, 2, 4, 64, 2, 32)).astype(np.float32),
                            "w_down": rng.normal(size=(1, 2, 4, 32, 64)).astype(np.float32),
                            "router": rng.normal(size=(1, 2, 64, 4)).astype(np.float32),
                            "stats": np.zeros((1, 2, 6), np.float32)}}}  # (a probe the
    # step adds to the params: no FSDP dimension of its own, framework/engine/moe_stats.py)
    compute, like = step_weights.once_a_step(model, lambda v: v, dims)(p)
    chunks = compute["chunks"]
    assert set(chunks) == {"params", fp8.SCALES, fp8.VALUES}
    assert all(a is b for a, b in zip(jax.tree.leaves(chunks["params"]),
                                      jax.tree.leaves(p["chunks"]), strict=True))
    assert chunks["params"]["attn"]["wqkv"] is p["chunks"]["attn"]["wqkv"]  # gathered per use
    assert chunks["params"]["moe"]["router"] is p["chunks"]["moe"]["router"]
    assert chunks["params"]["moe"]["stats"] is p["chunks"]["moe"]["stats"]
    assert jax.tree.map(np.shape, chunks[fp8.SCALES]) == {"moe": {"w_gate_up": (1, 2),
                                                                  "w_down": (1, 2)}}
    assert jax.tree.map(lambda a: a.dtype, chunks[fp8.VALUES]) == {
        "moe": {"w_gate_up": np.uint8, "w_down": np.uint8}}
    for name in ("w_gate_up", "w_down"):  # each layer's matrix as its use quantizes it
        w8 = fp8.from_bits(chunks[fp8.VALUES]["moe"][name])
        for layer in range(2):
            one, scale = fp8.quantize(p["chunks"]["moe"][name][0, layer].astype(jnp.bfloat16),
                                      fp8.E4M3, lambda v: v)
            assert np.array_equal(np.asarray(w8[0, layer]), np.asarray(one))
            np.testing.assert_allclose(chunks[fp8.SCALES]["moe"][name][0, layer], scale,
                                       rtol=1e-6)  # (XLA's division or its reciprocal)
    assert all(a is b for a, b in zip(jax.tree.leaves(like["chunks"]["params"]),
                                      jax.tree.leaves(p["chunks"]), strict=True))
    assert fp8.SCALES in like["chunks"]
    assert jax.tree.leaves(like["chunks"][fp8.VALUES]) == []  # no accumulator for the bits
    assert step_weights.once_a_step(MOE, lambda v: v, dims) is None  # no FP8


def test_the_fp8_copy_is_one_byte_an_element_and_no_stash_slot_keeps_it():
    """The once-a-step copy of the FP8 matrices is their E4M3 bits, one byte an element
    (bfloat16's copy: two), with no accumulator; and without remat a stash slot keeps
    none of it (the FP8 matmul's backward keeps the bits, the layer's own weights, not a
    cast of them: until 2026-12-01 each slot kept every layer's E4M3 weights). Traced
    (`executor_state`: the tick executor's state and copy, per device)."""
    from framework.analysis import executor_state as es
    from framework.config import ParallelConfig

    layout = ParallelConfig(pipeline=2, microbatches=4, schedule="1f1b", remat="none")
    state = {mode: es.executor_state(dataclasses.replace(BF16, fp8=mode), layout, 8, 64, "cpu")
             for mode in ("none", "tensorwise")}
    stage = BF16.n_layers // 2  # a rank's layers; each layer's FP8 matrices, elements:
    hd = BF16.d_model // BF16.n_heads
    matrices = stage * BF16.d_model * ((BF16.n_heads + 2 * BF16.n_kv_heads) * hd
                                       + BF16.n_heads * hd + 3 * BF16.d_ff)
    scales = 4 * stage * 4  # float32, per matrix and layer
    assert state["none"]["weights"] - state["tensorwise"]["weights"] == matrices - scales
    # (the scales' zero accumulators; none for the bits)
    assert state["tensorwise"]["grads"] == state["none"]["grads"] + scales
    assert state["tensorwise"]["stash"] < state["none"]["stash"]  # (x8: one byte too)


def test_zero1s_fp8_gather_brings_the_bits_and_the_copy_holds_none_of_them():
    """ZeRO-1's FP8 gather brings each FP8 matrix's E4M3 bits (fp8.VALUES, one byte an
    element) beside its values, which only take the gradient: the tick executor's
    once-a-step copy casts none of them to the compute dtype (until 2026-12-02 it held
    the gathered values in bfloat16, two bytes an element: llama3_70b with FP8 on
    gpu:h100x64, 34.88 -> 33.32 GiB compiled), and the bits get no accumulator. Traced
    (`executor_state`, per device)."""
    from framework.analysis import executor_state as es
    from framework.config import ParallelConfig

    layout = ParallelConfig(pipeline=2, data=2, microbatches=2, schedule="1f1b", zero1=True)
    state = {mode: es.executor_state(dataclasses.replace(BF16, fp8=mode), layout, 8, 64, "cpu")
             for mode in ("none", "tensorwise")}
    stage = BF16.n_layers // 2  # a rank's layers; each layer's FP8 matrices, elements:
    hd = BF16.d_model // BF16.n_heads
    matrices = stage * BF16.d_model * ((BF16.n_heads + 2 * BF16.n_kv_heads) * hd
                                       + BF16.n_heads * hd + 3 * BF16.d_ff)
    assert state["none"]["weights"] - state["tensorwise"]["weights"] == 2 * matrices
    assert state["tensorwise"]["weight_casts"] == state["none"]["weight_casts"]
    scales = 4 * stage * 4  # float32, per matrix and layer: their (zero) accumulators
    assert state["tensorwise"]["grads"] == state["none"]["grads"] + scales


@pytest.mark.slow  # ~25 s: four engines
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_zero1_gathers_the_matrices_in_the_compute_dtype_changing_no_number(schedule,
                                                                            monkeypatch):
    """ZeRO-1's gather sends the layers' and the head's matrices in bfloat16 (every use
    casts them so first: framework/parallel/data.py `gather_params`): the same loss and
    gradients as gathering them in float32, under autodiff and the tick executor."""
    from framework.parallel import data as data_parallel

    layout = dict(pipeline=2, data=2, tensor=1, microbatches=2, schedule=schedule,
                  zero1=True)
    narrow = engine_grads(engine(model=BF16, **layout))
    plain = data_parallel.gather_params
    monkeypatch.setattr(data_parallel, "gather_params",
                        lambda params, dims, dtype=None: plain(params, dims))
    wide = engine_grads(engine(model=BF16, **layout))
    assert narrow[0] == wide[0]
    assert worst(max_rel_err(narrow[1], wide[1])) == 0.0


@pytest.mark.slow  # ~60 s: two engines, two steps each
def test_fsdp_per_use_quantizes_the_whole_experts_once_changing_no_number(monkeypatch):
    """FSDP per use with the experts whole on each device (expert = data), delayed FP8,
    the routers' statistics probe in the step: the experts quantized once a step give
    the losses, the trained parameters and every history of quantizing them at each
    use, to the bit."""
    from tests.parity.test_fp8_moe import SHARED_SIGMOID, _fp8

    model = _fp8(SHARED_SIGMOID, "delayed")
    layout = dict(pipeline=2, data=2, tensor=1, expert=2, microbatches=2, schedule="1f1b",
                  fsdp=True)
    once = engine_losses(engine(model=model, **layout), 2)
    plain = step_weights.once_a_step
    monkeypatch.setattr(step_weights, "once_a_step", lambda m, w, per_use=None: None
                        if per_use is not None else plain(m, w))
    per_use = engine_losses(engine(model=model, **layout), 2)
    assert once[0] == per_use[0]
    assert worst(max_rel_err(once[1], per_use[1])) == 0.0
