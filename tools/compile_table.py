"""The compile reports of one or more folders as one Markdown table: compiled and
predicted memory per device, their ratio, compile time, bytes per mesh axis, overlap.

    python -m framework.compile -m recipe=llama3_8b target=gpu:h100x8 \\
        parallel.schedule=gpipe,1f1b,interleaved_1f1b,zb_h1 hydra.sweep.dir=sweeps/8b
    python tools/compile_table.py sweeps/8b [more folders ...]

Every `compile_report.json` under the folders is a row (framework/compile/report.py),
also those of programs that did not fit (the TPU compiler's figure is then its
temporaries alone).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from framework.parallel.mesh import AXES, EXPERT  # noqa: E402
from framework.units import GIB, MIB  # noqa: E402


def _gib(value) -> str:
    return "-" if value is None else f"{value / GIB:.1f}"


SENT = AXES + (EXPERT,)  # every mesh axis, `expert` last (absent from dense meshes: 0)


def row(report: dict) -> str:
    compiled = report.get("memory/compiled_bytes_per_device")
    if compiled is None and report.get("memory/temp_bytes_per_device"):
        compiled_text = f"> {_gib(report['memory/temp_bytes_per_device'])} (temps)"
    else:
        compiled_text = _gib(compiled)
    predicted = report.get("memory/predicted_bytes_per_device")
    ratio = f"{predicted / compiled:.2f}" if predicted and compiled else "-"
    sent = " / ".join(f"{report.get(f'comm/bytes_per_step/{a}', 0) / MIB:,.0f}"
                      for a in SENT) if compiled else "-"
    shares = [report.get(f"comm/overlapped_fraction/{a}")
              for a in SENT + ("pipe_sends", "context_sends")]
    overlap = (" / ".join("-" if s is None else f"{s:.0%}" for s in shares)
               if any(f"comm/overlapped_fraction/{a}" in report for a in AXES) else "-")
    seconds = report.get("compile_time_s")
    m = report.get("accumulated_microbatches")
    schedule = report["schedule"] + (f", {report['sends']}" if "sends" in report else "") + (
        ", combined" if report.get("combined_1f1b") else "") + (f", accumulated x{m}" if m else "")
    return (f"| {report.get('recipe') or '-'} | {report['target']} | "
            f"{report.get('mesh', '-')} | {schedule} | "
            f"{compiled_text} | {_gib(report.get('memory/device_bytes'))} | "
            f"{'yes' if report.get('fits') else 'no'} | {_gib(predicted)} | {ratio} | "
            f"{'-' if seconds is None else f'{seconds:.0f}'} | {sent} | {overlap} | "
            f"{_predicted_time(report)} |")


def _predicted_time(report: dict) -> str:
    step, mfu = report.get("time/predicted_step_s"), report.get("time/predicted_mfu")
    return "-" if step is None else f"{step * 1e3:,.0f} ms, MFU {mfu:.0%}"


HEADER = ("| recipe | target | layout | schedule | compiled GiB/device | device GiB | fits | "
          "predicted GiB | predicted / compiled | compile s | MiB sent/step pipe / data / "
          "context / tensor / expert | overlapped pipe / data / context / tensor / expert / "
          "pipe sends / context sends | planner's step (MFU) |\n|" + "---|" * 13)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    reports = [json.loads(p.read_text()) for folder in args.folders
               for p in sorted(folder.rglob("compile_report.json"))]
    if not reports:
        print(f"error: no compile_report.json under {', '.join(map(str, args.folders))}",
              file=sys.stderr)
        return 2
    print(HEADER)
    for report in reports:
        print(row(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
