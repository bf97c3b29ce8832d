"""FP8 matmuls (`model.fp8=tensorwise`, framework/model/fp8.py): the same numbers on every
layout as on one device whose microbatches are the data replicas' (data x microbatches
of them: the scaling unit is a replica's microbatch), close to full precision, the
quantizer against a float64 reference at its range's edges, and the settings FP8 does
not run with refused in one line."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from framework.config import ParallelConfig
from framework.engine.validate import check, check_platform
from framework.errors import ConfigError
from framework.model import fp8
from tests.helpers import MODEL, TRAIN, engine, engine_grads, max_rel_err, reference_grads, worst

FP8 = dataclasses.replace(MODEL, fp8="tensorwise")
LAYOUTS = [
    dict(pipeline=2, data=2, tensor=2, microbatches=2),  # GPipe: autodiff linearizes the forward
    dict(pipeline=2, data=2, tensor=2, microbatches=2, schedule="1f1b"),
    dict(pipeline=2, data=1, tensor=2, microbatches=4, schedule="zb_h1", sequence_parallel=True),
    dict(pipeline=2, data=2, tensor=1, microbatches=2, schedule="interleaved_1f1b",
         virtual_stages=2, zero1=True),
    dict(pipeline=1, data=2, tensor=2, microbatches=2, fsdp=True),
]
_ONE = {}


def _one_device(microbatches: int):
    if microbatches not in _ONE:
        _ONE[microbatches] = engine_grads(engine(1, 1, 1, microbatches, model=FP8))
    return _ONE[microbatches]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda kw: "-".join(
    f"{k[:4]}{v}" for k, v in kw.items()))
def test_fp8_on_a_layout_equals_one_device(layout):
    loss, grads = engine_grads(engine(model=FP8, **layout))
    ref_loss, ref_grads = _one_device(layout["data"] * layout["microbatches"])
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    assert worst(max_rel_err(grads, ref_grads)) < 1e-5


def test_fp8_is_close_to_full_precision():
    """The loss within 0.1% of the float32 model's; every gradient leaf within the
    E5M2 gradients' few-percent error (2 mantissa bits: 12.5% per element at worst)."""
    loss, grads = _one_device(1)
    ref_loss, ref_grads = reference_grads(MODEL)
    assert abs(loss - float(ref_loss)) < 1e-3 * abs(float(ref_loss))
    assert 0 < worst(max_rel_err(grads, ref_grads)) < 0.3


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_quantize_against_a_float64_reference(dtype):
    x = np.array([0.0, 1e-9, -3.3, 7.0, -12.5, 2.0**-20], np.float64)
    got, scale = fp8.quantize(jnp.asarray(x, jnp.float32), dtype, lambda v: v)
    largest = float(ml_dtypes.finfo(dtype).max)
    want_scale = 12.5 / largest
    assert float(scale) == pytest.approx(want_scale, rel=1e-6)
    want = (x / np.float64(np.float32(want_scale))).astype(np.float32).astype(dtype)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert float(np.abs(np.asarray(got, np.float64)).max()) == largest  # the edge reached
    zeros, unit = fp8.quantize(jnp.zeros(4), dtype, lambda v: v)
    assert not np.asarray(zeros, np.float32).any()
    assert float(unit) == pytest.approx(1.0 / largest, rel=1e-6)


def test_the_cotangent_einsums():
    assert fp8._transposed("bsd,dgjk->bsgjk") == ("bsgjk,dgjk->bsd", "bsd,bsgjk->dgjk")
    x, w = jnp.ones((2, 3, 16)), jnp.ones((16, 32))
    y, vjp = jax.vjp(lambda a, b: fp8.fp8_einsum("bsd,df->bsf", a, b, lambda v: v), x, w)
    dx, dw = vjp(jnp.ones_like(y))
    np.testing.assert_allclose(np.asarray(y), 16.0, rtol=1e-6)  # ones are exact in FP8;
    np.testing.assert_allclose(np.asarray(dx), 32.0, rtol=1e-6)  # the scales round in f32
    np.testing.assert_allclose(np.asarray(dw), 6.0, rtol=1e-6)


def test_what_fp8_does_not_run_with_is_one_line():
    bad = dataclasses.replace(MODEL, fp8="delayed")
    assert any("model.fp8='delayed' is not one of none, tensorwise" in e
               for e in check(bad, ParallelConfig(), TRAIN, 1))
    rings = ParallelConfig(tensor=2, sequence_parallel=True, collective_matmul=True)
    assert any("parallel.collective_matmul=false" in e for e in check(FP8, rings, TRAIN, 2))
    with pytest.raises(ConfigError, match="TPU v5p has none"):
        check_platform(FP8, "tpu")
    narrow = dataclasses.replace(FP8, d_model=72, n_heads=8, n_kv_heads=4, d_ff=120)
    with pytest.raises(ConfigError, match="model.d_model=72, model.d_ff=120"):
        check_platform(narrow, "gpu")
    with pytest.warns(UserWarning, match="emulated"):
        check_platform(FP8, "cpu")
