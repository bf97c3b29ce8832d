"""Throughput and MFU of a measured step: tokens per second, TFLOP/s per device and
the model FLOP utilisation.

MFU = achieved model FLOP/s per device / the device's peak dense FLOP/s for the
number format of the layers' matmuls: the compute dtype, or FP8 with `model.fp8`
(`matmul_format`; the run's summary names it, `perf/mfu_format`). Model FLOPs per token are counted in `framework/model/flops.py` (PaLM,
appendix B: no recomputation, full score matrices); the peaks are the device
catalogue's (`framework/hardware.py`). Unknown devices (CPU, or float32 on TPU) give
None, logged as null.
"""

from __future__ import annotations

from framework import hardware


def throughput(tokens_per_sec: float, n_devices: int, flops_token: float,
               peak: float | None) -> dict:
    """The perf/* numbers derived from a measured token rate."""
    per_device = flops_token * tokens_per_sec / n_devices  # FLOP/s
    return {
        "perf/tokens_per_sec": tokens_per_sec,
        "perf/tokens_per_sec_per_device": tokens_per_sec / n_devices,
        "perf/tflops_per_device": per_device / 1e12,
        "perf/mfu": None if peak is None else per_device / peak,
    }


def matmul_format(fp8: str, dtype: str) -> str:
    """The number format the layers' matmuls run in, whose peak MFU is measured against:
    FP8's (`hardware.FP8`) with `model.fp8`, else the compute dtype's."""
    return dtype if fp8 == "none" else hardware.FP8


def per_step_time(device_kind: str, dtype: str, n_devices: int, tokens_per_step: int,
                  flops_token: float, fp8: str = "none"):
    """step time (s) -> the perf/* numbers of a run on these devices (`throughput`,
    against the device's peak for the layers' matmul format, `matmul_format`). With
    FP8 also `perf/mfu_<dtype>`: against the compute dtype's peak, as a run without
    FP8 counts it (the same model FLOPs; FP8's peak is twice bfloat16's on Hopper)."""
    peak = hardware.peak_flops(device_kind, matmul_format(fp8, dtype))
    compute_peak = hardware.peak_flops(device_kind, dtype)

    def perf(step_time: float) -> dict:
        out = throughput(tokens_per_step / step_time, n_devices, flops_token, peak)
        if fp8 != "none":
            mfu = out["perf/tflops_per_device"] * 1e12 / compute_peak if compute_peak else None
            out[f"perf/mfu_{dtype}"] = mfu
        return out

    return perf
