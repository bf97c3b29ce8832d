"""Stored parameter dtype (`optim.param_dtype`, framework/engine/optim.py): bfloat16
master weights train like the single-device reference with bfloat16 weights, on a
pipelined layout; the optimizer keeps float32 moments; a checkpoint restores across
dtypes (read as saved, its fingerprints checked, then cast), and generation reads a
bfloat16 checkpoint as float32."""

import dataclasses

import jax
import numpy as np
import pytest

from framework.io.checkpoint.manager import Checkpointer
from tests.helpers import (OPTIM, engine, engine_losses, max_rel_err, params,
                           reference_losses, tokens, worst)

BF16 = dataclasses.replace(OPTIM, param_dtype="bfloat16")
BF16_STEP = 2.0 ** -7  # bfloat16's spacing relative to a power of two (8 bits)


def dtypes(tree) -> list[str]:
    return sorted({str(a.dtype) for a in jax.tree.leaves(tree)})


@pytest.mark.slow  # 5-11 s each: a (2,2,2) engine's three steps
@pytest.mark.parametrize("kw", [
    dict(schedule="1f1b", zero1=True),
    dict(schedule="gpipe", sequence_parallel=True),
    dict(schedule="zb_h1", fsdp=True),  # bfloat16 shards gathered as stored
], ids=["1f1b-zero1", "gpipe-sp", "zb_h1-fsdp"])
def test_bfloat16_parameters_train_like_the_reference(kw):
    """Three steps: the same losses (to the rounding of bfloat16 gradients summed per
    microbatch rather than over the batch), parameters at most two bfloat16 steps from
    the reference's and far fewer of them off than a float32 run's rounded ones."""
    ref_losses, ref_params = reference_losses(3, optim=BF16)
    f32_losses, f32_params = reference_losses(3)
    assert abs(ref_losses[2] - f32_losses[2]) > 9e-5  # the rounding is measurable
    eng = engine(2, 2, 2, 4, optim=BF16, **kw)
    losses, final = engine_losses(eng, 3)
    assert dtypes(final) == ["bfloat16"]
    np.testing.assert_allclose(losses[:2], ref_losses[:2], rtol=1e-7)
    assert abs(losses[2] - ref_losses[2]) <= 4e-5  # measured: 3e-6 (1f1b), 2.7e-5 (gpipe)
    assert worst(max_rel_err(final, ref_params)) <= 2 * BF16_STEP
    # measured: 16% of the entries differ (by a step); 46% for float32 training rounded
    assert off_fraction(final, ref_params) < 0.5 * off_fraction(f32_params, ref_params)


def off_fraction(tree, ref) -> float:
    """The fraction of entries of `tree`, rounded to bfloat16, unequal to `ref`'s."""
    pairs = [(np.asarray(np.asarray(a).astype("bfloat16"), np.float32),
              np.asarray(b, np.float32)) for a, b in zip(jax.tree.leaves(tree),
                                                         jax.tree.leaves(ref))]
    return sum(int((a != b).sum()) for a, b in pairs) / sum(a.size for a, _ in pairs)


@pytest.mark.slow  # 12 s: two engines compile their steps
def test_state_dtypes_and_restore_across_them(tmp_path):
    """float32 -> bfloat16 -> float32 through checkpoints of another layout: read as
    saved and cast (not taken for damage), the moments float32 throughout."""
    f32 = engine(2, 1, 2, 2, schedule="1f1b")
    bf16 = engine(1, 2, 2, 2, optim=BF16, zero1=True)
    state = f32.init_state(params())
    state, _ = f32.step(state, f32.shard_batch(tokens(0)))
    ckpt = Checkpointer(str(tmp_path), keep=3, async_save=False)
    ckpt.save(1, f32.layout, state)
    narrow = ckpt.restore(bf16.layout, 1)
    assert dtypes(narrow["params"]) == ["bfloat16"]
    assert dtypes(narrow["opt_state"]) == ["float32", "int32"]  # mu, nu, count
    expect = jax.tree.map(lambda a: np.asarray(a).astype("bfloat16").astype("float32"),
                          f32.layout.to_canonical(state)["params"])
    got = bf16.layout.to_canonical(narrow)["params"]
    assert worst(max_rel_err(jax.tree.map(lambda a: np.asarray(a, np.float32), got),
                             expect)) == 0.0  # exactly the rounded float32 values
    narrow, _ = bf16.step(narrow, bf16.shard_batch(tokens(1)))
    ckpt.save(2, bf16.layout, narrow)
    assert ckpt.saved_dtypes(2)["params/embed/table"] == "bfloat16"  # Orbax's metadata
    wide = ckpt.restore(f32.layout, 2)
    assert dtypes(wide["params"]) == ["float32"]
    assert worst(max_rel_err(f32.layout.to_canonical(wide)["params"],
                             bf16.layout.to_canonical(narrow)["params"])) == 0.0
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, np.float32,
                                                         sharding=a.sharding),
                          f32.layout.to_canonical(wide)["params"])
    loaded = ckpt.restore_params(2, shapes)  # what generation and export read
    assert dtypes(loaded) == ["float32"]
    ckpt.close()


@pytest.mark.slow  # fast tier <= 5 min (2026-11-28: 4 s)
def test_bfloat16_checkpoint_damage_is_still_found(tmp_path, monkeypatch):
    """Restored into a float32 layout, a bfloat16 checkpoint's fingerprints are checked
    on the arrays as saved, before the cast: intact, it restores; with one saved
    fingerprint off, it is damage."""
    from framework.errors import DamagedCheckpoint

    bf16, f32 = engine(1, 2, 1, 1, optim=BF16), engine(1, 2, 1, 1)
    ckpt = Checkpointer(str(tmp_path), keep=1, async_save=False)
    ckpt.save(0, bf16.layout, bf16.init_state(params()))
    assert dtypes(ckpt.restore(f32.layout, 0)["params"]) == ["float32"]
    meta = ckpt.metadata(0)
    prints = dict(meta["fingerprints"], **{"params/embed/table": [1, 2]})
    monkeypatch.setattr(ckpt, "metadata", lambda step=None: dict(meta, fingerprints=prints))
    with pytest.raises(DamagedCheckpoint, match="params/embed/table"):
        ckpt.restore(f32.layout, 0)
    ckpt.close()
