"""One tensor-parallel plan: the rules of framework/parallel/rules.py decide the shard_map specs,
the model's per-device weight shapes and where Megatron's collectives go. Changing a
rule therefore either still computes the single-device model or fails when the engine
is built; it cannot leave specs and model disagreeing."""

import dataclasses

import pytest

from framework.parallel import rules as sharding
from framework.config import ParallelConfig
from framework.errors import PlanError
from framework.parallel.tensor import TensorParallel
from tests.helpers import MODEL, engine, engine_grads, max_rel_err, reference_grads, worst


@pytest.fixture(scope="module")
def ref_grads():
    return reference_grads()


def test_local_shapes_come_from_the_rules():
    tp = TensorParallel("tensor", 4)
    assert tp.local_shape((64, 4, 4, 8), ("embed", "kv_heads", "qkv", "head_dim")) == (64, 1, 4, 8)
    assert tp.local_shape((128, 64), ("mlp", "embed")) == (32, 64)
    assert TensorParallel().local_shape((128, 64), ("mlp", "embed")) == (128, 64)
    no_mlp = tuple(r for r in sharding.param_rules() if r[0] != "mlp")
    replicated = TensorParallel("tensor", 4, rules=no_mlp)
    assert replicated.local_shape((128, 64), ("mlp", "embed")) == (128, 64)


@pytest.mark.parametrize("split,sp", [
    pytest.param(("heads", "kv_heads", "vocab"), True,  # MLP replicated: on its
                 marks=pytest.mark.slow),  # sequence slice (~5 s)
    (("mlp", "vocab"), True),  # attention replicated: gathers the sequence, keeps its slice
    (("heads", "kv_heads", "mlp"), False),  # vocabulary replicated: plain embedding and head
], ids=["no-mlp", "no-heads", "no-vocab"])
def test_changed_rule_keeps_parity(split, sp, ref_grads):
    ref_loss, ref_g = ref_grads
    loss, grads = engine_grads(engine(1, 2, 4, 2, sequence_parallel=sp, tensor_split=split))
    assert abs(loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert worst(max_rel_err(grads, ref_g)) <= 1e-4


@pytest.mark.parametrize("split,sp,message", [
    (("heads", "kv_heads", "mlp", "vocab", "norm"), False, "can only split"),
    (("heads", "mlp", "vocab"), False, "heads and kv_heads"),
    (("heads", "kv_heads", "mlp"), True, "sequence parallelism needs the vocabulary"),
], ids=["norm", "heads-alone", "sp-without-vocab"])
def test_rule_the_model_cannot_run_fails_loudly(split, sp, message):
    with pytest.raises(PlanError, match=message):
        engine(1, 2, 4, 2, sequence_parallel=sp, tensor_split=split)


def test_memory_model_follows_the_rules():
    """The planner's parameter bytes come from the same rules: replicating the MLP over
    tensor=4 adds 3/4 of its weights to every device."""
    from framework.analysis import memory_model
    from tests.helpers import TRAIN

    par = ParallelConfig(tensor=4)
    before = memory_model.predict_memory(MODEL, par, TRAIN)["params"]
    no_mlp = dataclasses.replace(par, tensor_split=("heads", "kv_heads", "vocab"))
    after = memory_model.predict_memory(MODEL, no_mlp, TRAIN)["params"]
    mlp = MODEL.n_layers * 3 * MODEL.d_model * MODEL.d_ff * 4  # float32 bytes
    assert after - before == pytest.approx(mlp * 3 / 4)
