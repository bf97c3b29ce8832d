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
    date: str = "2026-11-27"
    jax: str = "0.11.2"


# the 1B recipe as measured: the loss over whole logits (model.loss_chunk since 2026-11-28)
_1B, _8B = ("recipe=llama_1b_8gpu", "model.loss_chunk=0"), "recipe=llama3_8b"
_NONE, _CUDNN = "parallel.remat=none", "model.attention=cudnn"
_BLOCKWISE = "model.attention=blockwise"
MEASURED: tuple[Measured, ...] = (
    # the one-GPU recipe as measured: 9 rows, the loss over the whole batch's logits
    Measured(("recipe=llama_1b_1gpu", "train.global_batch_size=9", "model.loss_chunk=0"),
             "cudnn", "none", SINGLE, 0.3113),
    Measured((*_1B, "parallel.schedule=1f1b"), "cudnn", "full", TICKS, 1.190),
    Measured((*_1B, "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2"),
             "cudnn", "full", TICKS, 1.214),
    Measured((*_1B, "parallel.schedule=gpipe"), "cudnn", "full", AUTODIFF, 1.318),
    Measured((*_1B, "parallel.schedule=zb_h1"), "cudnn", "full", SPLIT, 1.702),
    Measured((*_1B, "parallel.schedule=1f1b", _NONE), "cudnn", "none", TICKS, 1.527),
    Measured((*_1B, "parallel.schedule=zb_h1", _NONE), "cudnn", "none", SPLIT, 1.766),
    Measured((*_1B, "parallel.schedule=zb_v", _NONE), "cudnn", "none", SPLIT, 1.588),
    # the 8B recipe as shipped until 2026-11-27 (blockwise attention; auto since)
    Measured((_8B, "parallel.schedule=1f1b", _BLOCKWISE), "blockwise", "full", TICKS, 3.113),
    Measured((_8B, "parallel.schedule=zb_h1", _BLOCKWISE), "blockwise", "full", SPLIT, 4.993),
    Measured((_8B, "parallel.schedule=1f1b", _CUDNN), "cudnn", "full", TICKS, 1.773),
    Measured((_8B, "parallel.schedule=zb_h1", _CUDNN), "cudnn", "full", SPLIT, 2.703),
    Measured((_8B, "parallel.schedule=1f1b", _CUDNN, _NONE), "cudnn", "none", TICKS, 2.021),
)

# (kernel, remat, executor kind) -> share of the peak the planner's FLOPs ran at: the
# mean over MEASURED's rows of that key (tools/calibrate.py, 2026-11-27).
RATES: dict[tuple[str, str, str], float] = {
    ("cudnn", "none", SINGLE): 0.4919,  # 1 row
    ("cudnn", "full", TICKS): 0.6615,  # 3 rows: 1B 1f1b, 1B interleaved, 8B 1f1b
    ("cudnn", "full", AUTODIFF): 0.6036,  # 1 row
    ("cudnn", "full", SPLIT): 0.6352,  # 2 rows: 1B and 8B zb_h1
    ("cudnn", "none", TICKS): 0.4363,  # 2 rows: 1B and 8B 1f1b (the stash's copies)
    ("cudnn", "none", SPLIT): 0.3880,  # 2 rows: 1B zb_h1, zb_v
    ("blockwise", "full", TICKS): 0.3763,  # 1 row
    ("blockwise", "full", SPLIT): 0.3414,  # 1 row
}
CALIBRATED = ("h200",)  # devices measured
EXTRAPOLATED = {"h100": "h200"}  # devices whose rates are another's, until measured


def rate(device_kind: str | None, kernel: str, remat: str, executor: str) -> float | None:
    """The measured share of the peak for a stage of this kind on this device, or None
    (not measured: the planner then assumes the peak). A kernel or remat not measured
    with this executor falls back to the same executor's other rows (their mean)."""
    if device_kind is None:
        return None
    kind = device_kind.lower()
    device = next((d for d in CALIBRATED if d in kind), None) or next(
        (EXTRAPOLATED[d] for d in EXTRAPOLATED if d in kind), None)
    if device is None:
        return None
    if (kernel, remat, executor) in RATES:
        return RATES[kernel, remat, executor]
    near = [r for (k, m, e), r in RATES.items() if e == executor and (k == kernel or m == remat)]
    return sum(near) / len(near) if near else None
