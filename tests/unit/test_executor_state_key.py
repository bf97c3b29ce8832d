"""`executor_state` keeps one trace per `state_key` (the planner asks for hundreds of
layouts that share far fewer states), so the key must hold every setting the state's
shapes depend on: two layouts with one key and different states would get one answer.
Until 2026-11-29 the key left out the expert plan and the planner counted Mixtral's every
expert's gradients on each device. Here every field of ParallelConfig is changed alone
from a pipelined MoE layout: either the key changes, or the traced states are equal.
A field added to ParallelConfig fails `test_every_parallel_setting_is_drawn` until it
has a row in CHANGES."""

import dataclasses

import pytest

from framework.analysis import executor_state as es
from framework.config import ModelConfig, MoeConfig, ParallelConfig, TrainConfig
from framework.engine.resolved import resolved, with_exchange
from framework.engine.step import passes_through
from framework.engine.validate import check

MODEL = ModelConfig(vocab_size=128, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                    d_ff=64, family="mixtral", moe=MoeConfig(experts=4, top_k=2))
SEQ, BATCH = 8, 32
BASE = dict(pipeline=2, data=2, tensor=2, microbatches=4, schedule="1f1b", expert=2)
# field: (what the base also sets, what the variant sets on top of that)
CHANGES = {
    "pipeline": ({}, dict(pipeline=4)),
    "data": ({}, dict(data=4)),
    "tensor": ({}, dict(tensor=1)),
    "microbatches": ({}, dict(microbatches=8)),
    "schedule": ({}, dict(schedule="zb_h1")),
    "virtual_stages": (dict(schedule="interleaved_1f1b"), dict(virtual_stages=2)),
    "remat": ({}, dict(remat="full")),
    "zero1": ({}, dict(zero1=True)),
    "fsdp": ({}, dict(fsdp=True)),
    "fsdp_regather": (dict(fsdp=True), dict(fsdp_regather="step")),
    "overlap_sends": ({}, dict(overlap_sends=False)),
    "sequence_parallel": ({}, dict(sequence_parallel=True)),
    "collective_matmul": (dict(sequence_parallel=True), dict(collective_matmul=True)),
    "tensor_split": ({}, dict(tensor_split=("heads", "kv_heads", "mlp"))),
    "stage_layers": ({}, dict(stage_layers=(1, 3))),
    "context": ({}, dict(context=2)),
    "expert": ({}, dict(expert=1)),
    "expert_exchange": ({}, dict(expert_exchange="ragged")),
    "expert_chunks": ({}, dict(expert_chunks=2)),
    "combined_1f1b": ({}, dict(combined_1f1b=True)),
}


def test_every_parallel_setting_is_drawn():
    missing = {f.name for f in dataclasses.fields(ParallelConfig)} - set(CHANGES)
    assert not missing, f"add a row to CHANGES for the new ParallelConfig field(s) {missing}"


def _layout(kw: dict, platform: str):
    parallel = ParallelConfig(**kw)
    devices = kw["pipeline"] * kw["data"] * kw["tensor"] * kw.get("context", 1)
    errors = check(MODEL, parallel, TrainConfig(seq_len=SEQ, global_batch_size=BATCH), devices)
    assert not errors, errors  # a layout the engine would run
    return resolved(MODEL, with_exchange(parallel, platform), SEQ, BATCH)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("field", sorted(CHANGES))
def test_one_key_means_one_state(field, platform):
    also, changed = CHANGES[field]
    a = _layout({**BASE, **also}, platform)
    b = _layout({**BASE, **also, **changed}, platform)
    through = passes_through(platform)
    if es.state_key(a) != es.state_key(b):
        return  # traced apart: nothing shared
    assert es.measure_executor_state(a, through) == es.measure_executor_state(b, through), (
        f"parallel.{field} changes the executor's state but not its state_key")
