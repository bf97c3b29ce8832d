"""The loss in chunks of tokens (`model.loss_chunk`, framework/model/loss.py) against the
naive loss over the whole batch's logits: the function alone (loss, dx, dw; z-loss and
Gemma 2's soft-cap, chunks that do not divide evenly into the requested size), and the
engine with chunks against the single-device reference (tied embeddings, a
vocabulary-parallel head with and without sequence parallelism, the sequence split
over `context`, FSDP, each executor's last stage)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework.model import reference
from framework.model.loss import chunk_count, chunked_cross_entropy_sum, cross_entropy_sum
from tests.helpers import MODEL, OPTIM, engine, engine_grads, max_rel_err, params, tokens, worst


def _inputs(b=3, s=10, d=16, v=40, seed=0):
    kx, kw, kt = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (b, s, d))  # [b, s, embed]
    w = jax.random.normal(kw, (d, v)) * 0.5  # [embed, vocab]
    t = jax.random.randint(kt, (b, s), 0, v)  # [b, s]
    return x, w, t


def test_chunk_count_is_the_fewest_equal_chunks():
    assert chunk_count(18432, 2048) == 9
    assert chunk_count(18432, 4096) == 6  # 3072 each: 4608 would be over
    assert chunk_count(30, 7) == 5 and chunk_count(7, 3) == 7 and chunk_count(8, 8) == 1


@pytest.mark.parametrize("z_loss,cap,chunk", [(0.0, None, 8), (1e-2, None, 7),
                                              (1e-2, 3.0, 12), (0.0, 3.0, 30)])
def test_chunked_matches_whole_logits(z_loss, cap, chunk):
    x, w, t = _inputs()

    def naive(x, w):
        logits = (x @ w).astype(jnp.float32)
        return cross_entropy_sum(logits if cap is None else cap * jnp.tanh(logits / cap), t,
                                 z_loss=z_loss)

    chunked = lambda x, w: chunked_cross_entropy_sum(x, w, t, z_loss=z_loss, cap=cap,
                                                     chunk=chunk)
    ref, ref_g = jax.value_and_grad(naive, argnums=(0, 1))(x, w)
    got, got_g = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(x, w)
    assert abs(float(got) - float(ref)) <= 1e-5 * abs(float(ref))
    assert float(jax.jit(chunked)(x, w)) == pytest.approx(float(got), rel=1e-6)  # no grads
    for a, b in zip(got_g, ref_g):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * float(jnp.abs(b).max()))


def test_bfloat16_chunks_round_like_the_whole_logits():
    """bfloat16 compute: the logits and d logits rounded as the naive head rounds them;
    dw summed over chunks in float32, so no further than bfloat16's rounding apart."""
    x, w, t = (a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in _inputs())
    naive = lambda x, w: cross_entropy_sum((x @ w).astype(jnp.float32), t)
    chunked = lambda x, w: chunked_cross_entropy_sum(x, w, t, chunk=6)
    ref, ref_g = jax.value_and_grad(naive, argnums=(0, 1))(x, w)
    got, got_g = jax.value_and_grad(chunked, argnums=(0, 1))(x, w)
    assert abs(float(got) - float(ref)) <= 2 ** -8 * abs(float(ref))  # logits' rounding
    for a, b in zip(got_g, ref_g):
        assert a.dtype == b.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 2 ** -7 * np.abs(b).max()


def _check(eng, model, z_loss=0.0):
    ref_loss, ref_grads = jax.jit(lambda p, t: reference.loss_and_grads(p, t, model, z_loss))(
        params(model), tokens(0))
    loss, grads = engine_grads(eng)
    assert abs(loss - float(ref_loss)) <= 1e-5 * float(ref_loss)
    assert worst(max_rel_err(grads, ref_grads)) <= 1e-4


TIED = dataclasses.replace(MODEL, tie_embeddings=True, loss_chunk=24)  # 4 rows of 16: 3 chunks


@pytest.mark.slow
def test_chunked_engine_matches_reference_on_one_device():
    """Training and the forward-only evaluation."""
    model = dataclasses.replace(TIED, n_layers=2)
    eng = engine(model=model, microbatches=4)
    _check(eng, model)
    evaluated = eng.eval_loss_fn()(eng.shard_params(params(model)), eng.shard_batch(tokens(0)))
    plain = reference.loss_fn(params(model), tokens(0), model)
    assert abs(float(evaluated) - float(plain)) <= 1e-5 * float(plain)  # forward only


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(pipeline=2, data=2, tensor=2, microbatches=2, schedule="1f1b",
         sequence_parallel=True),
    dict(pipeline=2, tensor=2, microbatches=4, schedule="zb_v", fsdp=True, data=2),
    dict(pipeline=2, data=2, microbatches=2, schedule="gpipe"),
    dict(pipeline=2, context=2, tensor=2, microbatches=2, schedule="1f1b"),
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_chunked_engine_matches_reference_with_z_loss_and_softcap(kw):
    model = dataclasses.replace(TIED, final_softcap=2.0)
    optim = dataclasses.replace(OPTIM, z_loss=1e-2)
    _check(engine(**kw, model=model, optim=optim), model, 1e-2)


def test_fsdp_per_use_saves_the_chunked_losss_gradients_not_each_chunks_product():
    """Under FSDP per use the head runs under the `save_dots` remat (its gathered weights
    gathered again for the backward, framework/engine/step.py); the chunked loss's
    gradients are saved by name (`loss.GRADS`), so the step holds no stack of every
    chunk's dw product [k, embed, vocab] f32, which JAX's remat kept to redo their sum
    in the backward until 2026-12-02 (qwen3_30b_a3b at 8 layers, FP8 delayed, on
    gpu:h100x8: 18.77 -> 17.40 GiB compiled, 12% fewer bytes read and written). Read
    from the lowered step (StableHLO)."""
    from tests.helpers import TRAIN

    model = dataclasses.replace(MODEL, loss_chunk=16)
    eng = engine(2, 2, 1, 2, model=model, schedule="1f1b", fsdp=True)
    k = chunk_count(TRAIN.global_batch_size // 4 * TRAIN.seq_len, 16)
    assert k > 1
    text = eng.step_fn.lower(*eng.abstract_inputs(TRAIN.global_batch_size,
                                                  TRAIN.seq_len)).as_text()
    stacked = f"tensor<{k}x{model.d_model}x{model.vocab_size}xf32>"
    assert stacked not in text
