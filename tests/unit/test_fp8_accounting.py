"""FP8 in the FLOP accounting (issue 45): the catalogue's FP8 peaks, MFU against the
peak of the layers' matmul format (and the compute dtype's beside it), the planner's
layers at the FP8 rate for their matmul share."""

import dataclasses

import pytest

from framework import hardware
from framework.analysis import flops, planner
from framework.config import ModelConfig, ParallelConfig, TrainConfig
from framework.model.flops import fp8_matmul_share, head_flops, model_flops_per_token

H100 = "NVIDIA H100 80GB HBM3"
MODEL = ModelConfig(vocab_size=32000, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8,
                    d_ff=4096, dtype="bfloat16")
FP8 = dataclasses.replace(MODEL, fp8="tensorwise")
TRAIN = TrainConfig(seq_len=2048, global_batch_size=32, steps=10)


def test_the_catalogue_has_hopper_fp8_peaks_twice_bfloat16():
    for kind in (H100, "NVIDIA H200", "NVIDIA H100 PCIe"):
        assert hardware.peak_flops(kind, hardware.FP8) == pytest.approx(
            2 * hardware.peak_flops(kind, "bfloat16"), rel=0.001)
    assert hardware.peak_flops(H100, hardware.FP8) == 1978.9e12
    assert hardware.peak_flops("NVIDIA A100-SXM4-80GB", hardware.FP8) is None
    assert hardware.peak_flops("TPU v5", hardware.FP8) is None


def test_mfu_is_against_the_peak_of_the_matmul_format():
    assert flops.matmul_format("tensorwise", "bfloat16") == hardware.FP8
    assert flops.matmul_format("none", "bfloat16") == "bfloat16"
    per_token = 1e9
    fp8 = flops.per_step_time(H100, "bfloat16", 8, 1000, per_token, "tensorwise")(0.5)
    bf16 = flops.per_step_time(H100, "bfloat16", 8, 1000, per_token)(0.5)
    assert fp8["perf/tflops_per_device"] == bf16["perf/tflops_per_device"] == 0.25
    assert fp8["perf/mfu"] == pytest.approx(0.25e12 / 1978.9e12)
    assert fp8["perf/mfu_bfloat16"] == bf16["perf/mfu"] == pytest.approx(0.25e12 / 989.4e12)
    assert "perf/mfu_bfloat16" not in bf16


def test_the_planner_runs_the_layers_matmul_share_at_the_fp8_rate():
    share = fp8_matmul_share(FP8, TRAIN.seq_len)
    layers = model_flops_per_token(MODEL, TRAIN.seq_len) - head_flops(MODEL)
    assert 0.5 < share < 1 and fp8_matmul_share(MODEL, TRAIN.seq_len) == 0.0
    assert share * layers == 6 * 8 * (1024 * 64 * (2 * 16 + 2 * 8) + 3 * 1024 * 4096)
    hw = planner.Hardware(memory_bytes=80e9, peak_flops=989.4e12, fp8_peak_flops=1978.9e12)
    par = ParallelConfig(pipeline=1, data=8)
    bf16, fp8 = (planner.predict_time(m, par, TRAIN, hw)["compute"] for m in (MODEL, FP8))
    head = head_flops(MODEL) * TRAIN.global_batch_size * TRAIN.seq_len / 8 / 989.4e12
    slower = share * 989.4 / 1978.9 + (1 - share)  # the rest at the bfloat16 peak
    assert fp8 - head == pytest.approx((bf16 - head) * slower, rel=1e-9)
    no_fp8_peak = dataclasses.replace(hw, fp8_peak_flops=None)
    assert planner.predict_time(FP8, par, TRAIN, no_fp8_peak)["compute"] == bf16
