"""`tools/plan.py --verify target=...`: the planner's best candidates compiled by the
target's own compiler (framework/compile/program.py, no devices needed), then ranked by
what the compiler says first (does the program fit the device?) and the predicted step
time second. The memory model is a prediction; the compiler's buffer assignment is the
program's memory: a candidate the compiler refuses or finds too big drops below every
one that fits."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from framework.units import memory_unit



@dataclass(frozen=True)
class Verified:
    plan: object  # framework.analysis.planner.Plan
    compiled_bytes: float | None  # the compiler's bytes per device (None: refused early)
    fits: bool  # the compiler's verdict against the device's memory
    overlapped: dict  # GPU: comm/overlapped_fraction/{pipe_sends,tensor}
    seconds: float  # lowering and compiling here
    note: str = ""  # why it does not fit, in one line


def verify(plans: list, cfg, target, top: int, log=os.devnull) -> list[Verified]:
    """Compiles the `top` best candidates the planner predicts to fit (and the best
    predicted not to, if fewer fit) for `target`; returns them ranked: fitting by the
    compiler first, then by predicted step time. The compilers' own logging (XLA's
    rematerialisation warnings, libtpu's start-up) goes to `log`."""
    from framework.compile.program import TooBig, compile_report
    from framework.runtime.quiet import stderr_to

    picked = [pl for pl in plans if pl.fits][:top] or plans[:top]
    out = []
    for pl in picked:
        run = dataclasses.replace(cfg, parallel=pl.parallel)
        try:
            with stderr_to(log):
                report = compile_report(run, target)
        except TooBig as err:
            found = err.report.get("memory/compiled_bytes_per_device",
                                   err.report.get("memory/temp_bytes_per_device"))
            out.append(Verified(pl, found, False, {}, 0.0, str(err).split(";")[0]))
            continue
        shares = {k.rsplit("/", 1)[1]: v for k, v in report.items()
                  if k in ("comm/overlapped_fraction/pipe_sends",
                           "comm/overlapped_fraction/tensor")}
        out.append(Verified(pl, report["memory/compiled_bytes_per_device"], report["fits"],
                            shares, report.get("compile_time_s", 0.0)))
    return sorted(out, key=lambda v: (not v.fits, v.plan.time["total"]))


def _layout(parallel) -> str:
    from framework.analysis.planner import sharding_name
    from framework.parallel.mesh import mesh_name

    shard = sharding_name(parallel)
    return mesh_name(parallel) + ("" if shard == "no" else f" {shard}")


def table(verified: list[Verified], target_name: str) -> str:
    unit, name = memory_unit(max((v.plan.memory["total"] for v in verified), default=0))
    head = (f"{'#':>3} {'layout':<40} {'predicted':>9} {'compiled':>9} {'ratio':>6} "
            f"{'fits':<4} {'step ms':>9} {'MFU':>6} {'pipe sends':>10} {'tensor':>7} "
            f"{'compile s':>9}")
    lines = [f"verified by the {target_name} compiler (memory in {name} per device; overlapped "
             f"shares of the stage-to-stage sends and of tensor bytes, GPU only):", head,
             "-" * len(head)]
    for i, v in enumerate(verified, 1):
        pred = v.plan.memory["total"]
        comp = "-" if v.compiled_bytes is None else f"{v.compiled_bytes / unit:.2f}"
        ratio = "-" if not v.compiled_bytes else f"{pred / v.compiled_bytes:.2f}"
        share = lambda k: "-" if v.overlapped.get(k) is None else f"{v.overlapped[k]:.0%}"
        lines.append(
            f"{i:>3} {_layout(v.plan.parallel):<40} {pred / unit:>9.2f} {comp:>9} {ratio:>6} "
            f"{'yes' if v.fits else 'NO':<4} {v.plan.time['total'] * 1e3:>9.4g} "
            f"{v.plan.time['mfu']:>6.1%} {share('pipe_sends'):>10} {share('tensor'):>7} "
            f"{v.seconds:>9.1f}" + (f"  {v.note}" if v.note else ""))
    best = next((v for v in verified if v.fits), None)
    lines.append(f"picked: {_layout(best.plan.parallel)} (the fastest predicted layout the "
                 "compiler fits)" if best else "picked: none of the candidates fits: "
                 "compile more (verify_top=...) or use more devices")
    return "\n".join(lines)
