"""The planner's compute rates from the measured stages of
framework/analysis/calibration.py: per row, the planner's FLOPs of the stage at the
device's peak over its measured time less its gradient accumulation's (priced at the
device's memory bandwidth, `framework/analysis/accumulation.py`); per (kernel, remat, executor) the mean, as
`RATES` holds it; and, with the rates in place, each row's predicted stage time
against its measurement; then FP8's measured ratios to bfloat16 (`FP8_SLOWDOWN`'s rows).

    python tools/calibrate.py            # the table, and RATES as Python
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from framework.runtime.quiet import start_cpu_only  # noqa: E402

start_cpu_only()  # nothing here runs on a device

from tools.recipe import compose  # noqa: E402


def stage_seconds(row, calibrated: bool) -> tuple[float, float]:
    """The planner's time of the row's stage (its head's rank, one step, no waits), and
    of it the gradient accumulation's (memory-bound: at the device's bandwidth, not
    at the compute rate)."""
    from framework import hardware
    from framework.analysis import planner
    from framework.engine.validate import validate

    cfg = compose(list(row.program))
    parallel = validate(cfg.model, cfg.parallel, cfg.train, cfg.parallel.n_devices)
    hw = planner.Hardware(memory_bytes=1.0, platform="gpu",
                          peak_flops=hardware.peak_flops(row.device, cfg.model.dtype),
                          device=row.device if calibrated else None,
                          memory_bandwidth=hardware.memory_bandwidth(row.device))
    time = planner.predict_time(cfg.model, parallel, cfg.train, hw, cfg.optim)
    return time["stage"], time["accumulate"]


def main() -> int:
    from framework.analysis.calibration import MEASURED

    shares = defaultdict(list)
    print(f"{'program':<78} {'measured ms':>11} {'at peak ms':>10} {'share':>6} "
          f"{'predicted ms':>12} {'ratio':>6}")
    for row in MEASURED:
        peak, added = stage_seconds(row, calibrated=False)
        share = (peak - added) / (row.step_s - added)  # the compute's share of the peak
        shares[row.kernel, row.remat, row.executor].append(share)
        predicted = stage_seconds(row, calibrated=True)[0]
        print(f"{' '.join(row.program):<78} {row.step_s * 1e3:>11.0f} {peak * 1e3:>10.0f} "
              f"{share:>6.1%} {predicted * 1e3:>12.0f} "
              f"{predicted / row.step_s:>6.2f}")
    print("\nRATES = {")
    for key, values in shares.items():
        print(f"    {key!r}: {sum(values) / len(values):.4f},  # {len(values)} row(s)")
    print("}")
    from framework.analysis.calibration import FP8_MEASURED, FP8_SLOWDOWN

    for row, bf16_s in FP8_MEASURED:
        print(f"{' '.join(row.program):<78} FP8 {row.step_s * 1e3:.0f} ms / bfloat16 "
              f"{bf16_s * 1e3:.0f} ms = {row.step_s / bf16_s:.3f}")
    print("FP8_SLOWDOWN (derived from them) = " +
          repr({d: round(v, 3) for d, v in FP8_SLOWDOWN.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
