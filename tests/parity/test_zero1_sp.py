"""ZeRO-1 and sequence parallelism keep parity with the single-device reference, and
ZeRO-1 shards the optimizer state (its communication: tests/compiled/test_audit.py)."""


import numpy as np
import pytest

from framework.analysis import audit
from tests.helpers import (engine, engine_grads, engine_losses, max_rel_err, params,
                           reference_grads, reference_losses, tokens, worst)


@pytest.fixture(scope="module")
def ref():
    return reference_grads()


@pytest.mark.parametrize("kw", [
    dict(pipeline=1, data=8, tensor=1, microbatches=1, zero1=True),
    dict(pipeline=2, data=2, tensor=2, microbatches=4, zero1=True),
    pytest.param(dict(pipeline=2, data=2, tensor=2, microbatches=4, zero1=True,
                      schedule="1f1b"), marks=pytest.mark.slow),
    pytest.param(dict(pipeline=1, data=1, tensor=4, microbatches=1, sequence_parallel=True),
                 marks=pytest.mark.slow),
    pytest.param(dict(pipeline=2, data=2, tensor=2, microbatches=4, sequence_parallel=True),
                 marks=pytest.mark.slow),
    pytest.param(dict(pipeline=2, data=1, tensor=4, microbatches=2, sequence_parallel=True,
                      schedule="1f1b", zero1=True), marks=pytest.mark.slow),
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_zero1_and_sequence_parallel_parity(kw, ref):
    loss, grads = engine_grads(engine(**kw))
    assert abs(loss - float(ref[0])) <= 1e-5 * float(ref[0])
    assert worst(max_rel_err(grads, ref[1])) <= 1e-4


@pytest.mark.slow
def test_zero1_trains_like_the_reference_and_shards_optimizer_state():
    ref_losses, ref_params = reference_losses(3)
    plain, zero1 = engine(1, 8, 1, 1), engine(1, 8, 1, 1, zero1=True)
    losses, final = engine_losses(zero1, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert worst(max_rel_err(final, ref_params)) <= 1e-4
    # Parameters + AdamW moments are the step's arguments: 1/8 of them per device.
    args = []
    for eng in (plain, zero1):
        state = eng.init_state(params())
        args.append(audit.step_stats(eng, state, eng.shard_batch(tokens(0)))["memory/argument_bytes_per_device"])
    assert args[1] < args[0] / 8 * 1.05, args
