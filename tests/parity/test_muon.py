"""Muon (`optim.name=muon`, framework/engine/optim.py): the layers' matrices take Muon's
orthogonalised update, the rest AdamW; three optimizer steps under pipeline, tensor
and data parallelism (ZeRO-1, FSDP) equal the single-device reference's, and the
optimizer state survives a checkpoint into another layout."""

import dataclasses

import jax
import numpy as np
import pytest

from framework.io.checkpoint.manager import Checkpointer
from tests.helpers import (OPTIM, engine, engine_losses, max_rel_err, params,
                           reference_losses, tokens, worst)

MUON = dataclasses.replace(OPTIM, name="muon")


@pytest.mark.parametrize("kw", [
    pytest.param(dict(pipeline=2, data=2, tensor=2, microbatches=4, schedule="1f1b",
                      zero1=True), marks=pytest.mark.slow),
    pytest.param(dict(pipeline=2, data=2, tensor=2, microbatches=4, schedule="zb_h1",
                      fsdp=True, sequence_parallel=True), marks=pytest.mark.slow),
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_muon_trains_like_the_reference(kw):
    ref_losses, ref_params = reference_losses(3, optim=MUON)
    adamw_losses, _ = reference_losses(3)
    assert abs(ref_losses[2] - adamw_losses[2]) > 1e-4  # another optimizer, measurably
    losses, final = engine_losses(engine(**kw, optim=MUON), 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert worst(max_rel_err(final, ref_params)) <= 1e-4


@pytest.mark.slow  # 11 s: the fast tier's time
def test_muon_state_restores_into_another_layout(tmp_path):
    """With a bfloat16 momentum (optim.mu_dtype): it is saved and restored as such."""
    optim = dataclasses.replace(MUON, mu_dtype="bfloat16")
    saving = engine(2, 2, 2, 4, schedule="1f1b", optim=optim)
    state = saving.init_state(params())
    for i in range(2):
        state, _ = saving.step(state, saving.shard_batch(tokens(i)))
    ckpt = Checkpointer(str(tmp_path), keep=1, async_save=False)
    ckpt.save(2, saving.layout, state)
    other = engine(1, 4, 2, 1, optim=optim, zero1=True)
    restored = ckpt.restore(other.layout)
    ckpt.close()
    dtypes = lambda s: sorted({str(a.dtype) for a in jax.tree.leaves(s["opt_state"])})
    assert "bfloat16" in dtypes(state) and dtypes(restored) == dtypes(state)
    _, a = saving.step(state, saving.shard_batch(tokens(2)))
    _, b = other.step(restored, other.shard_batch(tokens(2)))
    assert abs(float(a["train/loss"]) - float(b["train/loss"])) <= 1e-5 * float(a["train/loss"])
    assert abs(float(a["train/grad_norm"]) - float(b["train/grad_norm"])) <= 1e-4 * float(
        a["train/grad_norm"])
