"""Document masks (`data.document_mask`, framework/model/documents.py): a packed row's
attention never crosses a document boundary. Measured three ways: a masked packed batch
against its documents run one by one (loss and every gradient, dense and blockwise
kernels, positions reset or not); the cuDNN wrapper's and the ring's masks against the
dense kernel's; the engine under pipeline, tensor and context parallelism against the
single-device masked reference. The bad settings are one-line errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework.config import DataConfig
from framework.errors import ConfigError
from framework.io.data import Dataset, document_mask
from framework.model import attention, reference
from framework.model.documents import DocumentMask, positions_in_document, segment_ids
from framework.model.llama import cross_entropy_sum
from tests.helpers import (canonical_of, MODEL, engine, max_rel_err, params, stub_cudnn_checks,
                           tokens, worst)

SEP = 0  # the end-of-document token of these tests


def packed(step: int = 0):
    """The helpers' tokens with 1 in 8 of them set to SEP: rows of several documents."""
    t = tokens(step)
    return jnp.where(t < MODEL.vocab_size // 8, SEP, t)


def test_segments_and_positions_of_a_packed_row():
    ids = jnp.array([[5, 7, SEP, 3, SEP, SEP, 9, 9]])
    assert segment_ids(ids, SEP).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert positions_in_document(segment_ids(ids, SEP)).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


def _one_by_one_loss(p, row_tokens, model):
    """The mean token loss of each row's documents run alone (each from position 0),
    with the targets they have in the row: what a masked packed batch must equal."""
    inputs, targets = row_tokens[:, :-1], row_tokens[:, 1:]
    total = 0.0
    for r in range(inputs.shape[0]):
        ends = [i + 1 for i, t in enumerate(inputs[r]) if t == SEP]  # a SEP ends its own
        for lo, hi in zip([0] + ends, ends + [inputs.shape[1]]):
            if hi > lo:
                logits = reference.forward(p, jnp.asarray(inputs[r:r + 1, lo:hi]), model)
                total = total + cross_entropy_sum(logits, jnp.asarray(targets[r:r + 1, lo:hi]))
    return total / targets.size


@pytest.mark.parametrize("kernel,reset", [
    pytest.param("dense", True, marks=pytest.mark.slow),
    pytest.param("blockwise", True, marks=pytest.mark.slow),
    pytest.param("blockwise", False, marks=pytest.mark.slow)])
def test_a_masked_packed_batch_is_its_documents_one_by_one(kernel, reset):
    model = dataclasses.replace(MODEL, attention=kernel, attention_block_q=4,
                                attention_block_kv=4, n_layers=2)
    p, batch = params(model), packed()[:2]
    loss, grads = jax.jit(lambda p, t: reference.loss_and_grads(
        p, t, model, documents=DocumentMask(SEP, reset)))(p, batch)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(
        lambda p: _one_by_one_loss(p, np.asarray(batch), model)))(p)  # a constant batch
    plain_loss = reference.loss_fn(p, batch, model)
    assert abs(float(loss - ref_loss)) <= 1e-6 * abs(float(ref_loss))
    assert abs(float(plain_loss - ref_loss)) > 1e-3  # the mask changes the numbers
    assert worst(max_rel_err(grads, ref_grads)) < 1e-5


def test_cudnn_wrappers_masks_match_the_dense_kernels():
    """The cuDNN wrapper's document masks (run with XLA's kernel: cuDNN needs a GPU), with
    equal and with shifted positions, against the dense kernel's (the ring's: the slow
    `test_masked_layouts_are_the_reference[ring...]`)."""
    b, n, g, r, hd = 2, 16, 2, 2, 8
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (b, n, g, r, hd))
    k, v = (jax.random.normal(key, (b, n, g, hd)) for key in keys[1:])
    seg = segment_ids(packed()[:b, :n], SEP)
    documents = attention.Mask(segments=(seg, seg))
    dense = attention.dense_attention(q, k, v, mask=documents)
    fused = attention.cudnn_attention(q, k, v, mask=documents, implementation="xla")
    assert float(jnp.max(jnp.abs(fused - dense))) < 1e-5
    shifted = attention.cudnn_attention(q[:, 8:], k, v, implementation="xla",
                                        mask=attention.Mask(8, 0, (seg[:, 8:], seg)))
    assert float(jnp.max(jnp.abs(shifted - dense[:, 8:]))) < 1e-5


def _engine_vs_reference(mask: DocumentMask, model=MODEL, **layout):
    eng = engine(model=model, documents=mask, **layout)
    loss, grads = eng.loss_and_grads_fn()(eng.shard_params(params(model)),
                                            eng.shard_batch(packed()))
    ref_loss, ref_grads = jax.jit(lambda p, t: reference.loss_and_grads(
        p, t, model, documents=mask))(params(model), packed())
    assert abs(float(loss - ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert worst(max_rel_err(canonical_of(eng, grads), ref_grads)) < 1e-4


def test_masked_1f1b_with_tensor_and_sequence_parallelism_is_the_reference():
    _engine_vs_reference(DocumentMask(SEP, reset_positions=True), pipeline=2, data=2,
                         tensor=2, microbatches=4, schedule="1f1b", sequence_parallel=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    dict(pipeline=2, data=2, tensor=2, microbatches=4, schedule="zb_h1", remat="full"),
    dict(pipeline=2, data=2, tensor=2, microbatches=4, schedule="gpipe"),
    dict(pipeline=2, context=2, tensor=2, microbatches=4, schedule="1f1b"),
    dict(pipeline=2, context=2, data=2, microbatches=2, schedule="interleaved_1f1b",
         virtual_stages=2, stage_layers=(1, 2, 3, 2)),
], ids=["zb_h1-remat", "gpipe", "ring", "ring-blockwise-interleaved-uneven"])
def test_masked_layouts_are_the_reference(layout):
    model = MODEL
    if layout.get("context"):
        model = dataclasses.replace(MODEL, attention="blockwise", attention_block_q=2,
                                    attention_block_kv=4)
    _engine_vs_reference(DocumentMask(SEP, reset_positions=True), model, **layout)


def test_cudnn_model_with_document_masks_traces(monkeypatch):
    """cuDNN's JAX side with its GPU checks stubbed, as tests/parity/test_attention.py:
    the masked step's gradients trace through the tick executor."""
    stub_cudnn_checks(monkeypatch)
    model = dataclasses.replace(MODEL, attention="cudnn", dtype="bfloat16")
    eng = engine(model=model, pipeline=2, data=2, microbatches=2, schedule="1f1b",
                 documents=DocumentMask(SEP))
    state, batch = eng.abstract_inputs(16, 16)
    jaxpr = str(jax.make_jaxpr(eng.loss_and_grads_fn())(state["params"], batch))
    assert "dot_product_attention" in jaxpr and "cumsum" in jaxpr


class _Data(Dataset):
    def __init__(self, separator):
        self.separator = separator


def test_document_mask_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="data.reset_positions=true .* needs "
                                          "data.document_mask=true"):
        document_mask(DataConfig(reset_positions=True), _Data(2), {})
    with pytest.raises(ConfigError, match="data.kind=synthetic has none .*--eos-id"):
        document_mask(DataConfig(document_mask=True), _Data(None), {})
    with pytest.raises(ConfigError, match="eval.sets.wiki ends documents with token 3"):
        document_mask(DataConfig(document_mask=True), _Data(2), {"wiki": _Data(3)})
    assert document_mask(DataConfig(), _Data(None), {}) is None
    assert document_mask(DataConfig(document_mask=True, reset_positions=True), _Data(2),
                         {"wiki": _Data(2)}) == DocumentMask(2, True)


def test_auto_attention_passes_cudnn_by_under_document_masks(monkeypatch):
    """cuDNN gets document masks as a [batch, 1, seq, seq] bias (quadratic memory):
    `auto` on a GPU runs blockwise under masks, cuDNN without."""
    calls = []
    monkeypatch.setattr(attention, "cudnn_attention", lambda *a, **k: calls.append(1))
    model = dataclasses.replace(MODEL, attention="auto", dtype="bfloat16")
    q = jnp.zeros((1, 1024, 2, 2, 16), jnp.bfloat16)
    k = jnp.zeros((1, 1024, 2, 16), jnp.bfloat16)
    segments = (jnp.zeros((1, 1024), jnp.int32),) * 2
    out = jax.eval_shape(lambda: attention.attend(q, k, k, model, platform="gpu",
                                                  segments=segments))
    assert out.shape == q.shape and calls == []
    jax.eval_shape(lambda: attention.attend(q, k, k, model, platform="gpu"))
    assert calls == [1]
