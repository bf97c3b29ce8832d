"""Throughput and MFU of a measured step: tokens per second, TFLOP/s per device and
the model FLOP utilisation.

MFU = achieved model FLOP/s per device / the device's peak dense FLOP/s for the
compute dtype. Model FLOPs per token are counted in `framework/model/flops.py` (PaLM,
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


def per_step_time(device_kind: str, dtype: str, n_devices: int, tokens_per_step: int,
                  flops_token: float):
    """step time (s) -> the perf/* numbers of a run on these devices (`throughput`, the
    device's peak for `dtype` from the catalogue)."""
    peak = hardware.peak_flops(device_kind, dtype)
    return lambda step_time: throughput(tokens_per_step / step_time, n_devices,
                                        flops_token, peak)
