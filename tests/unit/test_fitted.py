"""The memory model's fitted constants (framework/analysis/fitted.py): every row says
where it was read from, and every row is read by the model: changing it changes the
prediction of a layout where it applies (a row nobody reads is a stale number)."""

import dataclasses
import re

import pytest

from framework.analysis import fitted, memory_model
from framework.config import ModelConfig, ParallelConfig, TrainConfig

MODEL = ModelConfig(vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
                    attention="dense")
TRAIN = TrainConfig(seq_len=64, global_batch_size=8)
# (row, a layout and platform whose prediction reads it[, the model's other settings])
WHERE = {
    "logit_copies/whole_batch": (ParallelConfig(), "cpu", "dense"),
    "logit_copies/per_microbatch": (ParallelConfig(pipeline=2, microbatches=4), "cpu", "dense"),
    "logit_copies/1f1b": (ParallelConfig(pipeline=2, microbatches=4, schedule="1f1b"), "cpu",
                          "dense"),
    "logit_copies/gpu": (ParallelConfig(pipeline=2, microbatches=4, schedule="1f1b"), "gpu",
                         "dense"),
    "logit_copies/tpu": (ParallelConfig(pipeline=2, microbatches=4, schedule="1f1b"), "tpu",
                         "dense"),
    "batch_copies/gpipe": (ParallelConfig(pipeline=2, microbatches=4), "cpu", "dense"),
    "batch_copies/tpu": (ParallelConfig(pipeline=2, microbatches=4), "tpu", "dense"),
    "layer_backward/tpu": (ParallelConfig(pipeline=2, microbatches=4, schedule="1f1b"), "tpu",
                           "dense"),
    "score_copies/dense": (ParallelConfig(), "cpu", "dense"),
    "score_copies/blockwise": (ParallelConfig(), "cpu", "blockwise"),
    "logit_copies/chunk": (ParallelConfig(), "gpu", "dense", {"loss_chunk": 128}),
    "head_weight_copies/chunk": (ParallelConfig(), "gpu", "dense", {"loss_chunk": 128}),
}


def test_every_row_has_its_provenance():
    assert set(WHERE) == set(fitted.FITTED)
    for name, row in fitted.FITTED.items():
        assert row.value > 0 and row.what and row.program and row.target, name
        assert re.fullmatch(r"\d+\.\d+\.\d+", row.jaxlib), name
        assert re.fullmatch(r"2026-\d\d-\d\d", row.date), name


@pytest.mark.parametrize("name", sorted(WHERE))
def test_every_row_is_read_by_the_memory_model(name, monkeypatch):
    parallel, platform, kernel, *more = WHERE[name]
    model = dataclasses.replace(MODEL, attention=kernel, **(more[0] if more else {}))
    before = memory_model.predict_memory(model, parallel, TRAIN, platform)["total"]
    row = fitted.FITTED[name]
    monkeypatch.setitem(fitted.FITTED, name, dataclasses.replace(row, value=row.value * 50))
    after = memory_model.predict_memory(model, parallel, TRAIN, platform)["total"]
    assert after > before, f"{name} is not read where it should be"
