"""The planner against what a GPU measured (framework/analysis/calibration.py): each
measured stage's predicted time within 10% (the rates are shared by the rows of a key:
1B and 8B, 1F1B and interleaved), and the ranking the measurements imply: under full
remat a zero-bubble stage redoes B's recomputation in W, so the planner never puts
ZB-H1 or ZB-V ahead of 1F1B there; without a measurement it assumes the peak, as before."""

import dataclasses

import pytest

from framework import hardware
from framework.analysis import calibration, planner
from framework.engine.validate import validate
from tests.helpers import compose_recipe


def _predict(overrides, device="h200"):
    recipe, *rest = overrides
    cfg = compose_recipe(recipe.split("=", 1)[1], *rest)
    parallel = validate(cfg.model, cfg.parallel, cfg.train, cfg.parallel.n_devices)
    hw = planner.Hardware(memory_bytes=1.0, platform="gpu", device=device,
                          peak_flops=hardware.peak_flops("h200", cfg.model.dtype),
                          fp8_peak_flops=hardware.peak_flops("h200", hardware.FP8))
    return planner.predict_time(cfg.model, parallel, cfg.train, hw, cfg.optim)


@pytest.mark.parametrize("row", calibration.MEASURED, ids=lambda r: " ".join(r.program[1:])
                         or r.program[0])
def test_each_measured_stage_is_predicted_within_ten_percent(row):
    predicted = _predict(row.program)["stage"]
    assert abs(predicted / row.step_s - 1) <= 0.10, (predicted, row.step_s)


@pytest.mark.parametrize("recipe", ["recipe=llama_1b_8gpu", "recipe=llama3_8b"])
@pytest.mark.parametrize("remat", ["full", "save_dots"])
@pytest.mark.parametrize("pipeline", [2, 4])
def test_zero_bubble_is_not_ranked_first_under_remat(recipe, remat, pipeline):
    """Under remat W rebuilds the chunk's backward (measured 1.14-1.43x a 1F1B stage):
    neither zero-bubble schedule is ranked ahead of 1F1B, at p 2 nor at p 4, though its
    bubble is smaller (docs/parallelism.md says when to pick it)."""
    layout = (f"parallel.pipeline={pipeline}", f"parallel.remat={remat}",
              *(("parallel.data=1", "parallel.tensor=2") if pipeline == 4 else ()))
    one = _predict((recipe, "parallel.schedule=1f1b", *layout))
    for schedule in ("zb_h1", "zb_v"):
        zb = _predict((recipe, f"parallel.schedule={schedule}", *layout))
        assert zb["total"] > one["total"] and zb["bubble"] < one["bubble"], schedule


@pytest.mark.parametrize("row, bf16_s", calibration.FP8_MEASURED,
                         ids=lambda r: r.program[0] if hasattr(r, "program") else "")
def test_each_fp8_stage_is_predicted_within_ten_percent(row, bf16_s):
    """FP8 at the measured ratio to bfloat16 (not at the FP8 peak, which would promise
    the 8B stage 0.6x its bfloat16 time where it ran 0.96x)."""
    fp8, bf16 = _predict(row.program)["stage"], _predict(row.program[:-1])["stage"]
    assert abs(fp8 / row.step_s - 1) <= 0.10, (fp8, row.step_s)
    # (the measured ratio is a whole step's; the planner scales the layers' time, and
    # the 1B's head, in the compute dtype, is a fifth of its FLOPs: 0.94 for 0.89)
    assert abs((fp8 / bf16) / (row.step_s / bf16_s) - 1) <= 0.08
    at_peak = _predict(row.program, device=None)["stage"] / _predict(row.program[:-1],
                                                                      device=None)["stage"]
    assert at_peak < 0.8  # what the FP8 peak alone would promise


def test_an_unmeasured_device_is_predicted_at_its_peak():
    assert calibration.rate("TPU v5", "blockwise", "full", calibration.TICKS) is None
    assert calibration.rate("NVIDIA H100 80GB HBM3", "cudnn", "full", calibration.TICKS) == \
        calibration.RATES["cudnn", "full", calibration.TICKS]  # the H200's, until measured
    at_peak = _predict(("recipe=llama_1b_8gpu", "parallel.schedule=1f1b"), device=None)
    measured = _predict(("recipe=llama_1b_8gpu", "parallel.schedule=1f1b"))
    assert at_peak["rate"] == 1.0 and measured["rate"] < 1.0
    assert at_peak["compute"] == pytest.approx(measured["compute"] * measured["rate"])
    assert dataclasses.replace(planner.Hardware(1.0, 1.0)).device is None


def test_a_kernel_never_measured_with_an_executor_takes_its_other_rows():
    """The blockwise kernel was measured only in pipelined stages; a layout without a
    pipeline that runs it (the 128k recipe before its ring ran cuDNN's pieces) took the
    peak, and the planner ranked it ahead of cuDNN's. Now its rate is the kernel's
    other rows'; cuDNN's without a pipeline stays the one-GPU row's."""
    h200 = "NVIDIA H200"
    blockwise = calibration.rate(h200, "blockwise", "full", calibration.SINGLE)
    rows = [r for (k, _, _), r in calibration.RATES.items() if k == "blockwise"]
    assert blockwise == pytest.approx(sum(rows) / len(rows))
    assert blockwise < calibration.rate(h200, "cudnn", "full", calibration.SINGLE) == \
        calibration.RATES["cudnn", "none", calibration.SINGLE]
