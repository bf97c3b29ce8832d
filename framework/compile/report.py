"""The compile report: printed as a short table and written to `compile_report.json` in
the run folder (keys as in framework/compile/program.py), with `summary.json` for
sweeps."""

from __future__ import annotations

from framework.units import MIB, size

REPORT_FILE = "compile_report.json"


def _gib(value) -> str:
    return "-" if value is None else size(value)


def _axes(report: dict, prefix: str) -> list[str]:
    return sorted(k.rsplit("/", 1)[1] for k in report if k.startswith(prefix))


def _accumulated(report: dict) -> str:
    m = report.get("accumulated_microbatches")
    return f", gradients accumulated over {m} microbatches" if m else ""


def lines(report: dict) -> list[str]:
    """The report as the command prints it."""
    predicted, compiled = (report.get("memory/predicted_bytes_per_device"),
                           report.get("memory/compiled_bytes_per_device"))
    ratio = f" ({predicted / compiled:.2f}x the compiler)" if predicted and compiled else ""
    out = [f"{report['target']}: {report['n_devices']} x {report['device_kind']}, "
           f"{report['mesh']} ({report['schedule']}"
           f"{', ' + report['sends'] + ' sends' if 'sends' in report else ''}"
           f"{_accumulated(report)}"
           f"{', combined 1F1B' if report.get('combined_1f1b') else ''}"
           f"{', ' + report['attention'] + ' attention' if 'attention' in report else ''}"
           f"), compiled in "
           f"{report['compile_time_s']:.1f} s",
           f"memory per device (compiler): arguments {_gib(report['memory/argument_bytes_per_device'])}"
           f", outputs {_gib(report['memory/output_bytes_per_device'])}, temporaries "
           f"{_gib(report['memory/temp_bytes_per_device'])}, total {_gib(compiled)} of "
           f"{_gib(report['memory/device_bytes'])}: {'fits' if report['fits'] else 'does not fit'}",
           f"memory per device (memory model): {_gib(predicted)}{ratio}"]
    comm = ", ".join(f"{a} {report[f'comm/bytes_per_step/{a}'] / MIB:,.1f} MiB"
                     for a in _axes(report, "comm/bytes_per_step/"))
    out.append(f"bytes sent per device per step: {comm}")
    shares = [(a, report[f"comm/overlapped_fraction/{a}"])
              for a in _axes(report, "comm/overlapped_fraction/")]
    if shares:
        out.append("overlapped with compute: " + ", ".join(
            f"{a} {'-' if s is None else f'{s:.0%}'}" for a, s in shares))
    if "traffic/copied_bytes_per_step" in report:
        out.append("moved without computing per device per step: " + ", ".join(
            f"{kind} {_gib(report[f'traffic/{kind}_bytes_per_step'])}"
            for kind in ("copied", "sliced", "updated")))
    if "traffic/accessed_bytes_per_step" in report:
        out.append("read and written by the kernels per device per step: "
                   f"{_gib(report['traffic/accessed_bytes_per_step'])}" + (
                       f" (gradient accumulation "
                       f"{_gib(report['traffic/accumulated_bytes_per_step'])})"
                       if report.get("traffic/accumulated_bytes_per_step") else ""))
    if "kernels/gemm_per_step" in report:
        out.append(_kernels_line(report))
    if report.get("flops/fp8_share_of_layer_matmuls") is not None:
        out.append(f"layers' matmul FLOPs on FP8 operands: "
                   f"{report['flops/fp8_share_of_layer_matmuls']:.0%}")
    flops = report["flops/model_per_device_per_step"]
    step = report.get("time/predicted_step_s")
    executed = report.get("flops/matmul_executed_over_model")
    out.append(f"model FLOPs per device per step: {flops / 1e12:,.1f} TFLOP"
               + (f" (the program's matmuls {executed:.2f}x that)" if executed else "")
               + (f"; planner's step time {step:.3f} s (MFU {report['time/predicted_mfu']:.0%}"
                  f" of the {report['time/mfu_format']} peak)" if step else ""))
    if "pipeline/bubble_fraction_table" in report:
        parts = report.get("pipeline/backward_parts", 1)
        out.append(f"schedule table: bubble {report['pipeline/bubble_fraction_table']:.1%}"
                   + (f", each BW in {parts} parts" if parts > 1 else ""))
    return out


def _kernels_line(report: dict) -> str:
    """Kernels per step by kind (framework/analysis/kernels.py)."""
    n = lambda kind: report[f"kernels/{kind}_per_step"]
    total = sum(v for k, v in report.items() if k.startswith("kernels/")
                and k != "kernels/scalar_all_reduce_per_step")
    scalar = n("scalar_all_reduce")
    parts = [f"GEMMs {n('gemm'):,.0f}", f"attention {n('attention'):,.0f}",
             f"collectives {n('collective'):,.0f}"
             + (f" ({scalar:,.0f} of one value)" if scalar else "")]
    if n("fp8_cast") or n("amax"):
        parts += [f"FP8 casts {n('fp8_cast'):,.0f}", f"absolute maxima {n('amax'):,.0f}"]
    parts += [f"other fusions {n('fusion'):,.0f}", f"other {n('other'):,.0f}"]
    return f"kernels per device per step: {total:,.0f} ({', '.join(parts)})"
