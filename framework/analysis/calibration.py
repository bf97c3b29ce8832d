"""What GPUs measured of this project's own stages, and the compute rates the planner
takes from them.

The planner's compute time is FLOPs over a rate. Without a measurement that rate is the
device's peak (a floor no program reaches: the one-GPU step ran at 49% of it, and a
blockwise-attention stage at 27%). Here each measured stage is a row (`MEASURED`): the
program as run, the device, the date, the JAX version, the attention kernel, the remat
policy, the executor kind and its step time. `RATES` holds, per (kernel, remat,
executor kind), the share of the peak at which the planner's FLOPs of such a stage ran:
the planner's FLOPs of the stage (hardware FLOPs: what remat recomputes included,
`framework/model/flops.py`) at peak over the measured time, averaged over the rows of
that key (`tools/calibrate.py` prints them; `tests/compiled/test_calibration.py` checks
each row's predicted stage time within 10% of its measurement).

A stage was timed as one GPU's share of the multi-GPU program through JAX's mock GPU
topology (`tools/mock_gpu.py --stage last`: the stage with the head, every collective a
no-op): its cells' time, without the bubble's waits or any communication. The rates are
an H200's (HBM3e, 4.8 TB/s); an H100 has the same dense peak and 3.35 TB/s, so its
memory-bound kernels run slower: its rates are the H200's until an H100 is measured
(`EXTRAPOLATED`).
"""

from __future__ import annotations

from dataclasses import dataclass

SINGLE, AUTODIFF, TICKS, SPLIT = "single", "autodiff", "ticks", "split"  # executor kinds


@dataclass(frozen=True)
class Measured:
    program: tuple  # the recipe and overrides as run (tools/mock_gpu.py, tools/bench.py)
    kernel: str  # the attention kernel the run used
    remat: str
    executor: str  # SINGLE (no pipeline), AUTODIFF (gpipe, circular), TICKS, SPLIT (ZB)
    step_s: float  # the stage's measured step time (median)
    device: str = "h200"
    date: str = "2026-11-27"  # the first GPU run's; later rows give theirs
    jax: str = "0.11.2"


# The rows of the program as it is: an H200, jax 0.11.2, 2026-11-30 (tools/device_check.sh;
# docs/performance.md "On a GPU again"); the GPipe and blockwise rows are 2026-11-27's.
_1B, _8B = "recipe=llama_1b_8gpu", "recipe=llama3_8b"
_FULL, _NONE, _DOTS = "parallel.remat=full", "parallel.remat=none", "parallel.remat=save_dots"
_BLOCKWISE = "model.attention=blockwise"
_ZB_H1, _ZB_V, _1F1B = ("parallel.schedule=zb_h1", "parallel.schedule=zb_v",
                        "parallel.schedule=1f1b")
_NOW = "2026-11-30"
MEASURED: tuple[Measured, ...] = (
    Measured(("recipe=llama_1b_1gpu",), "cudnn", "none", SINGLE, 0.4664, date=_NOW),
    Measured((_1B, _1F1B, _FULL), "cudnn", "full", TICKS, 1.1812, date=_NOW),
    Measured((_1B, "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2", _FULL),
             "cudnn", "full", TICKS, 1.1647, date=_NOW),
    Measured((_1B, _ZB_H1, _FULL), "cudnn", "full", SPLIT, 1.6416, date=_NOW),
    Measured((_1B, _ZB_V, _FULL), "cudnn", "full", SPLIT, 1.4015, date=_NOW),
    Measured((_1B, _1F1B, _NONE), "cudnn", "none", TICKS, 1.1418, date=_NOW),
    Measured((_1B, _ZB_V, _NONE), "cudnn", "none", SPLIT, 1.2332, date=_NOW),
    Measured((_1B, _1F1B, _DOTS), "cudnn", "save_dots", TICKS, 1.0970, date=_NOW),
    Measured((_1B, _ZB_H1, _DOTS), "cudnn", "save_dots", SPLIT, 1.5007, date=_NOW),
    Measured((_1B, _ZB_V, _DOTS), "cudnn", "save_dots", SPLIT, 1.2528, date=_NOW),
    Measured((_8B, _1F1B, _FULL), "cudnn", "full", TICKS, 1.6684, date=_NOW),
    Measured((_8B, _ZB_V, _FULL), "cudnn", "full", SPLIT, 2.3855, date=_NOW),
    Measured((_8B, _1F1B, _DOTS), "cudnn", "save_dots", TICKS, 1.5405, date=_NOW),
    Measured((_8B, _ZB_V, _DOTS), "cudnn", "save_dots", SPLIT, 2.0212, date=_NOW),
    # 2026-11-27 (GPipe's program has not changed since; the 1B loss then over whole logits)
    Measured((_1B, "model.loss_chunk=0", "parallel.schedule=gpipe", _FULL), "cudnn", "full",
             AUTODIFF, 1.318),
    # the 8B recipe as shipped until 2026-11-27 (blockwise attention; auto since)
    Measured((_8B, _1F1B, _FULL, _BLOCKWISE), "blockwise", "full", TICKS, 3.113),
    Measured((_8B, _ZB_H1, _FULL, _BLOCKWISE), "blockwise", "full", SPLIT, 4.993),
)

# (kernel, remat, executor kind) -> share of the peak the planner's FLOPs ran at: the
# mean over MEASURED's rows of that key, each row's time less its gradient accumulation's
# at the device's memory bandwidth (framework/analysis/accumulation.py: 12 ms of the 1B
# 1F1B stage, 17 ms of the 8B's) (tools/calibrate.py, 2026-12-03). One key holds
# ZB-H1 and ZB-V, whose planner FLOPs are the same: ZB-H1's stage ran 1.17x ZB-V's
# (1B, full remat), so each is predicted 8-9% off, on either side.
RATES: dict[tuple[str, str, str], float] = {
    ("cudnn", "none", SINGLE): 0.5108,  # 1 row
    ("cudnn", "full", TICKS): 0.6935,  # 3 rows: 1B 1f1b, 1B interleaved, 8B 1f1b
    ("cudnn", "full", SPLIT): 0.7240,  # 3 rows: 1B zb_h1 and zb_v, 8B zb_v
    ("cudnn", "none", TICKS): 0.5746,  # 1 row: 1B 1f1b
    ("cudnn", "none", SPLIT): 0.5316,  # 1 row: 1B zb_v
    ("cudnn", "save_dots", TICKS): 0.5960,  # 2 rows: 1B and 8B 1f1b
    ("cudnn", "save_dots", SPLIT): 0.6161,  # 3 rows: 1B zb_h1 and zb_v, 8B zb_v
    ("cudnn", "full", AUTODIFF): 0.6096,  # 1 row
    ("blockwise", "full", TICKS): 0.3783,  # 1 row
    ("blockwise", "full", SPLIT): 0.3426,  # 1 row
}
# FP8 (issue 45): the same program with `model.fp8=tensorwise` and without, on the same
# device and day (tools/device_check.sh: bench and bench_fp8; the 8B stage under full
# remat, mock_8b_full and mock_8b_fp8 with parallel.remat=full): (the FP8 row, the bfloat16
# step time). The FLOPs at the FP8 peak would promise 0.6x; per-tensor current scaling
# reads each matmul input again for its amax and to quantize (docs/performance.md).
FP8_MEASURED: tuple[tuple[Measured, float], ...] = (
    (Measured(("recipe=llama_1b_1gpu", "model.fp8=tensorwise"), "cudnn", "none", SINGLE,
              0.4152, date=_NOW), 0.4664),  # 0.890
    (Measured((_8B, _1F1B, _FULL, "model.fp8=tensorwise"), "cudnn", "full", TICKS, 1.5978,
              date=_NOW), 1.6684),  # 0.958
)
# device -> a stage's time with model.fp8=tensorwise over its bfloat16 time: the mean
# over FP8_MEASURED's rows of that device (h200: 0.924)
FP8_SLOWDOWN: dict[str, float] = {
    d: sum(r.step_s / b for r, b in FP8_MEASURED if r.device == d)
    / sum(1 for r, _ in FP8_MEASURED if r.device == d)
    for d in {r.device for r, _ in FP8_MEASURED}}
CALIBRATED = ("h200",)  # devices measured
EXTRAPOLATED = {"h100": "h200"}  # devices whose rates are another's, until measured


def _measured_device(device_kind: str | None) -> str | None:
    """The measured device whose figures stand for `device_kind` (itself, or the one it
    is extrapolated from), or None."""
    if device_kind is None:
        return None
    kind = device_kind.lower()
    return next((d for d in CALIBRATED if d in kind), None) or next(
        (EXTRAPOLATED[d] for d in EXTRAPOLATED if d in kind), None)


def fp8_slowdown(device_kind: str | None) -> float | None:
    """A stage's time with `model.fp8` over its bfloat16 time as measured on this device
    (`FP8_SLOWDOWN`), or None (not measured)."""
    return FP8_SLOWDOWN.get(_measured_device(device_kind))


def rate(device_kind: str | None, kernel: str, remat: str, executor: str) -> float | None:
    """The measured share of the peak for a stage of this kind on this device, or None
    (not measured: the planner then assumes the peak). A kernel or remat not measured
    with this executor falls back to the same executor's rows of that kernel or remat
    (their mean); a kernel never measured with this executor, to that kernel's rows of
    every executor (the blockwise kernel ran at about half cuDNN's rate in every stage
    measured: a layout without a pipeline that runs it is not at the peak)."""
    if _measured_device(device_kind) is None:
        return None
    if (kernel, remat, executor) in RATES:
        return RATES[kernel, remat, executor]
    near = [r for (k, m, e), r in RATES.items() if e == executor and (k == kernel or m == remat)]
    if not any(k == kernel and e == executor for k, _, e in RATES):
        near = [r for (k, _, _), r in RATES.items() if k == kernel] or near
    return sum(near) / len(near) if near else None


def executor_kind(lay) -> str:
    """The executor kind of a layout (`framework.engine.resolved.Layout`)."""
    if lay.parallel.pipeline == 1:
        return SINGLE
    if lay.program.schedule.split_backward:
        return SPLIT
    return AUTODIFF if lay.program.autodiff else TICKS


def layout_rate(lay, seq_len: int, device_kind: str | None, platform: str | None) -> float | None:
    """The share of the peak a stage of this layout ran at on `device_kind` (None: not
    measured): by its attention kernel as `auto` resolves on the platform, its remat
    and its executor kind."""
    from framework.engine.resolved import REMATS
    from framework.model.attention import kernel_for

    if device_kind is None:
        return None
    kernel = kernel_for(lay.model, seq_len, platform or "gpu")
    return rate(device_kind, kernel, REMATS[lay.layer_remat].rated_as, executor_kind(lay))
