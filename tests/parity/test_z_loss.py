"""The z-loss (`optim.z_loss`, PaLM): + z (log Z)^2 per token, on the vocabulary-
parallel head, exact against the single-device reference under a pipeline with tensor
and sequence parallelism; evaluation reports the cross-entropy alone."""

import dataclasses

import jax
import pytest

from framework.model import reference
from tests.helpers import (OPTIM, engine, engine_grads, max_rel_err, params, tokens,
                           worst)

Z = 1e-2


@pytest.mark.parametrize("kw", [
    pytest.param(dict(pipeline=2, data=2, tensor=2, microbatches=4, schedule="1f1b",
                      sequence_parallel=True), marks=pytest.mark.slow),
    pytest.param(dict(pipeline=2, data=2, tensor=2, microbatches=4, schedule="zb_v",
                      fsdp=True), marks=pytest.mark.slow),
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_z_loss_parity(kw):
    eng = engine(**kw, optim=dataclasses.replace(OPTIM, z_loss=Z))
    ref_loss, ref_grads = jax.jit(lambda p, t: reference.loss_and_grads(
        p, t, eng.model, Z))(params(eng.model), tokens(0))
    plain = float(reference.loss_fn(params(eng.model), tokens(0), eng.model))
    assert float(ref_loss) > plain * 1.001  # the term is there, and is not small
    loss, grads = engine_grads(eng)
    assert abs(loss - float(ref_loss)) <= 1e-5 * float(ref_loss)
    assert worst(max_rel_err(grads, ref_grads)) <= 1e-4
    eval_loss = float(eng.eval_loss_fn()(eng.shard_params(params(eng.model)),
                                    eng.shard_batch(tokens(0))))
    assert abs(eval_loss - plain) <= 1e-5 * plain
