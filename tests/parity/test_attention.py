"""The attention kernels (framework/model/attention.py): blockwise and the cuDNN wrapper against
the dense reference, kernel by kernel and through the engine (loss and every gradient
leaf against the single-device dense model, in the layouts and schedules there are),
what `auto` picks. (Blockwise memory against the sequence: tests/compiled/test_memory.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework.model import attention
from framework.errors import ConfigError
from framework.config import ParallelConfig, TrainConfig
from framework.engine.validate import check
from tests.helpers import (MODEL, engine, engine_grads, max_rel_err, reference_grads,
                           stub_cudnn_checks, worst)


def _qkv(b, sq, sk, g, r, hd, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, sq, g, r, hd), dtype),
            jax.random.normal(ks[1], (b, sk, g, hd), dtype),
            jax.random.normal(ks[2], (b, sk, g, hd), dtype),
            jax.random.normal(ks[3], (b, sq, g, r, hd), dtype))  # output weights for a loss


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("shape,blocks,offsets", [
    ((2, 16, 16, 2, 2, 8), (4, 4), (0, 0)),  # several blocks, causal ones skipped
    ((2, 17, 17, 2, 3, 8), (4, 5), (0, 0)),  # blocks that do not divide the sequence
    ((1, 5, 20, 2, 2, 8), (2, 4), (15, 0)),  # a decode-like chunk: queries at 15..19
], ids=["divisible", "ragged", "offset"])
def test_blockwise_equals_dense_values_and_gradients(shape, blocks, offsets):
    q, k, v, w = _qkv(*shape)
    qo, ko = offsets
    tiles = attention.Blocks(*blocks)
    dense = lambda q, k, v: attention.dense_attention(q, k, v, mask=attention.Mask(qo, ko))
    block = lambda q, k, v: attention.blockwise_attention(
        q, k, v, mask=attention.Mask(qo, ko), blocks=tiles)
    loss = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))
    (ld, gd), (lb, gb) = loss(dense)(q, k, v), loss(block)(q, k, v)
    assert _rel(block(q, k, v), dense(q, k, v)) < 1e-5
    assert abs(float(lb) - float(ld)) < 1e-5 * abs(float(ld))
    for a, b in zip(gb, gd):
        assert _rel(a, b) < 1e-5
    # Traced offsets (a cache position) give the same result.
    traced = jax.jit(lambda q, k, v, o: attention.blockwise_attention(
        q, k, v, mask=attention.Mask(o, ko), blocks=tiles))
    assert _rel(traced(q, k, v, jnp.int32(qo)), dense(q, k, v)) < 1e-5


def _plain_attention(q, k, v, q_offset, window, scale, cap):
    """Sliding-window, soft-capped GQA attention written out in numpy, float64: the
    reference of the kernels' window and soft-cap (a key visible iff q - k < window)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bsgrd,btgd->bgrst", q, k) * scale
    s = cap * np.tanh(s / cap)
    q_pos = q_offset + np.arange(q.shape[1])[:, None]
    k_pos = np.arange(k.shape[1])[None, :]
    s = np.where((k_pos <= q_pos) & (q_pos - k_pos < window), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bgrst,btgd->bsgrd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("shape,blocks,offset,window", [
    ((2, 16, 16, 2, 2, 8), (4, 4), 0, 5),  # key blocks wholly outside the window skipped
    pytest.param((2, 17, 17, 2, 3, 8), (4, 5), 0, 3, marks=pytest.mark.slow),  # ragged
    ((1, 5, 20, 2, 2, 8), (2, 4), 15, 7),  # decode-like: queries 15..19 see keys > q - 7
], ids=["divisible", "ragged", "offset"])
def test_window_and_softcap_kernels_values_and_gradients(shape, blocks, offset, window):
    q, k, v, w = _qkv(*shape)
    q, k = 3 * q, 3 * k  # scores beyond the cap, so that tanh bends them
    form = attention.ScoreForm(scale=0.3, softcap=5.0)
    plain = _plain_attention(q, k, v, offset, window, 0.3, 5.0)
    kw = dict(mask=attention.Mask(q_offset=offset, window=window), form=form)
    dense = lambda q, k, v: attention.dense_attention(q, k, v, **kw)
    block = lambda q, k, v: attention.blockwise_attention(
        q, k, v, blocks=attention.Blocks(*blocks), **kw)
    assert _rel(dense(q, k, v), plain) < 1e-5 and _rel(block(q, k, v), plain) < 1e-5
    loss = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))
    (ld, gd), (lb, gb) = loss(dense)(q, k, v), loss(block)(q, k, v)
    assert abs(float(lb) - float(ld)) < 1e-5 * abs(float(ld))
    for a, b in zip(gb, gd):
        assert _rel(a, b) < 1e-5
    # A traced window (one scanned with the layers) and traced offsets: the same.
    traced = jax.jit(lambda q, k, v, o, win: attention.blockwise_attention(
        q, k, v, mask=attention.Mask(q_offset=o, window=win), form=form,
        blocks=attention.Blocks(*blocks)))
    assert _rel(traced(q, k, v, jnp.int32(offset), jnp.int32(window)), plain) < 1e-5
    # The cuDNN wrapper's window (no soft-cap there), through XLA's kernel.
    cudnn = attention.cudnn_attention(q, k, v, mask=kw["mask"], scale=0.3, implementation="xla")
    assert _rel(cudnn, _plain_attention(q, k, v, offset, window, 0.3, 1e9)) < 1e-5


def test_blockwise_bfloat16_keeps_float32_statistics():
    q, k, v, _ = _qkv(2, 64, 64, 2, 2, 16, jnp.bfloat16)
    exact = attention.dense_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    out = attention.blockwise_attention(q, k, v, blocks=attention.Blocks(16, 16))
    assert out.dtype == jnp.bfloat16
    assert _rel(out, exact) < 2e-2  # bfloat16 rounding of inputs/outputs only


def test_cudnn_wrapper_layout_and_masks_via_xla():
    """The GQA head order and the causal mask/offset handling of `cudnn_attention`,
    checked by running the same call with XLA's kernel (cuDNN needs a GPU)."""
    q, k, v, _ = _qkv(2, 12, 12, 2, 3, 8)
    ref = attention.dense_attention(q, k, v)
    assert _rel(attention.cudnn_attention(q, k, v, implementation="xla"), ref) < 1e-5
    q2 = q[:, 8:]  # queries 8..11 against all 12 keys: an explicit mask
    eight = attention.Mask(q_offset=8)
    out = attention.cudnn_attention(q2, k, v, mask=eight, implementation="xla")
    assert _rel(out, attention.dense_attention(q2, k, v, mask=eight)) < 1e-5
    loss = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))),
                                      argnums=(0, 1, 2)))
    fused = lambda q, k, v: attention.cudnn_attention(q, k, v, implementation="xla")
    for a, b in zip(loss(fused)(q, k, v), loss(attention.dense_attention)(q, k, v)):
        assert _rel(a, b) < 1e-5  # the wrapper's own VJP


@pytest.mark.parametrize("kw", [dict(pipeline=2, microbatches=2), dict(
    pipeline=2, microbatches=4, schedule="circular", virtual_stages=2), dict(
    pipeline=2, microbatches=2, schedule="1f1b"), dict(pipeline=2, microbatches=2,
    schedule="zb_h1"), dict(tensor=2, sequence_parallel=True), dict(
    pipeline=2, microbatches=2, schedule="1f1b", model=dict(sliding_window=5)), dict(
    context=2, tensor=2, sequence_parallel=True)],
    ids=["gpipe", "circular", "1f1b", "zb_h1", "sp", "window", "ring"])
def test_cudnn_model_traces_in_every_schedule(kw, monkeypatch):
    """cuDNN's kernel cannot run here, but its JAX side can be traced with its GPU
    checks stubbed: gradients of the engine's step trace through every pipeline
    executor (which differentiate stages inside an outer differentiation and stash
    residuals by type), under sequence parallelism, and in ring attention's pieces
    (framework/model/fused_pieces.py: cuDNN's backward kernel handed the whole
    attention's output and log-sum-exp)."""
    stub_cudnn_checks(monkeypatch)
    kw = dict(kw)  # window: one on every layer, cuDNN's own (local_window_size)
    model = dataclasses.replace(MODEL, attention="cudnn", dtype="bfloat16", **kw.pop("model", {}))
    eng = engine(model=model, data=2, **kw)
    state, tokens = eng.abstract_inputs(16, 16)
    jaxpr = jax.make_jaxpr(eng.loss_and_grads_fn())(state["params"], tokens)
    assert "dot_product_attention" in str(jaxpr)
    if eng.parallel.context > 1:
        assert "dot_product_attention_bwd" in str(jaxpr)
    if model.sliding_window:  # JAX hands cuDNN the window: the query and 4 keys before it
        assert "sliding_window_length=5" in str(jaxpr)


def test_auto_choice_and_settings_validation():
    assert attention.choose("cpu", jnp.float32, 64, 16) == "dense"
    assert attention.choose("cpu", jnp.float32, attention.DENSE_MAX_SEQ * 4, 16) == "blockwise"
    assert attention.choose("gpu", jnp.bfloat16, 2048, 64) == "cudnn"
    assert attention.choose("gpu", jnp.float32, 4096, 64) == "blockwise"  # no fp32 cuDNN kernel
    assert attention.choose("tpu", jnp.bfloat16, 4096, 128) == "blockwise"
    errs = lambda **kw: check(dataclasses.replace(MODEL, **kw), ParallelConfig(), TrainConfig(), 1)
    assert errs() == []
    assert errs(attention="flash") == ["model.attention='flash' is not one of auto, dense, "
                                       "blockwise, cudnn"]
    assert "needs model.dtype=bfloat16" in errs(attention="cudnn")[0]
    assert errs(attention="blockwise", attention_block_q=0) == [
        "model.attention_block_q=0 must be >= 1"]
    with pytest.raises(ConfigError, match="needs an NVIDIA GPU"):
        attention.check_platform(dataclasses.replace(MODEL, attention="cudnn"), "cpu")
    # A soft-cap: cuDNN has none, `auto` passes it by, `cudnn` is refused in one line;
    # so is a window that differs between layers (cuDNN's is static).
    assert attention.choose("gpu", jnp.bfloat16, 2048, 64, no_cudnn=True) == "blockwise"
    bf16 = dict(attention="cudnn", dtype="bfloat16")
    assert errs(**bf16, attn_softcap=50.0) == [
        "model.attention=cudnn cannot soft-cap scores (model.attn_softcap=50.0; cuDNN's fused "
        "attention has no soft-cap): use model.attention=auto, dense or blockwise"]
    assert "one window on every layer" in errs(**bf16, sliding_window=4,
                                               sliding_window_pattern=2)[0]
    assert errs(**bf16, sliding_window=4) == []  # Mistral's: one window, cuDNN's own
    assert errs(sliding_window_pattern=2) == [
        "model.sliding_window_pattern=2 needs model.sliding_window (the local layers' window)"]
    assert errs(activation="relu") == ["model.activation='relu' is not one of silu, gelu_tanh"]
    from framework.config import RunConfig, check_ranges
    bad = RunConfig(model=dataclasses.replace(MODEL, sliding_window=0, attn_softcap=-1.0))
    assert [e.split(" ")[0] for e in check_ranges(bad)] == ["model.sliding_window=0",
                                                             "model.attn_softcap=-1.0"]


# Block sizes that split the test sequence (16) into several, unevenly.
BLOCKWISE = dataclasses.replace(MODEL, attention="blockwise", attention_block_q=6,
                                attention_block_kv=4)


@pytest.fixture(scope="module")
def dense_reference():
    return reference_grads(dataclasses.replace(MODEL, attention="dense"))


# The kernel runs inside a stage: one schedule per executor (autodiff: circular; ticks,
# backward fused: 1f1b; split: zb_h1) is what can differ. Single and zb_h1 are fast.
@pytest.mark.parametrize("pp,dp,tp,mb,kw", [
    (1, 1, 1, 1, {}),
    pytest.param(2, 2, 2, 4, dict(schedule="circular", virtual_stages=2), marks=pytest.mark.slow),
    pytest.param(2, 2, 2, 4, dict(schedule="1f1b"), marks=pytest.mark.slow),
    pytest.param(2, 2, 2, 4, dict(schedule="zb_h1"), marks=pytest.mark.slow),
    pytest.param(1, 1, 4, 1, {}, marks=pytest.mark.slow),
    pytest.param(1, 2, 4, 2, dict(sequence_parallel=True), marks=pytest.mark.slow),
], ids=["single", "circular", "1f1b", "zb_h1", "tp4", "sp"])
def test_blockwise_model_matches_dense_reference(pp, dp, tp, mb, kw, dense_reference):
    ref_loss, ref_grads = dense_reference
    loss, grads = engine_grads(engine(pp, dp, tp, mb, model=BLOCKWISE, **kw))
    assert abs(loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    errs = max_rel_err(grads, ref_grads)
    assert worst(errs) <= 1e-4, errs


@pytest.mark.slow
def test_auto_and_bfloat16_blockwise_models(dense_reference):
    # auto on CPU at this length is dense: the same numbers as the reference.
    ref_loss, ref_grads = dense_reference
    auto = dataclasses.replace(MODEL, attention="auto")
    loss, grads = engine_grads(engine(1, 1, 1, 1, model=auto))
    assert worst(max_rel_err(grads, ref_grads)) <= 1e-4
    bf16 = dataclasses.replace(BLOCKWISE, dtype="bfloat16")
    ref_loss, ref_grads = reference_grads(dataclasses.replace(bf16, attention="dense"))
    loss, grads = engine_grads(engine(1, 1, 2, 1, model=bf16, sequence_parallel=True))
    assert abs(loss - float(ref_loss)) < 2e-2 * float(ref_loss)
    assert worst(max_rel_err(grads, ref_grads)) < 0.1  # bf16 rounding, not a kernel bug
