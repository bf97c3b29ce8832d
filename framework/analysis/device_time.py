"""Where a step's device time goes: the kernels of a profiled step, grouped by kind.

`jax.profiler` records one event per executed HLO op (on a GPU the line `XLA Ops` of the
plane `/device:GPU:<n>`; on a CPU the host threads' thunks), each with its op name in
the `hlo_op` stat and its duration. `breakdown` sums them per kind of work:

    matmul        GEMMs: cuBLAS calls and XLA's matmul fusions (`gemm_fusion_dot...`,
                  `...dot...`, `cublas`)
    attention     the fused attention kernel (cuDNN's flash attention custom calls)
    copies/slices data moved, not computed: copies, dynamic slices and updates (the
                  stash going in and out of the tick loop's carried buffers), transposes
    collectives   all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all
    elementwise   the other fusions (norms, activations, casts, softmax pieces, the loss)
    other         what is left (a CUDA graph's `command_buffer` would hide what it
                  launches: `ungraphed` turns them off for a profiled run)

and reports per step: seconds by kind, kernels launched, and the ops that took longest
(their names without XLA's numeric suffix). `tools/mock_gpu.py --profile` and
`tools/bench.py --profile` print it.
"""

from __future__ import annotations

import glob
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

# XLA:GPU runs runs of kernels as CUDA graphs (`command_buffer` ops); the profiler then
# sees one op per graph and none of the kernels inside (an H200, jax 0.11.2, 2026-11-30:
# 237 of 466 ms a step seen, all as "other"). Off, every kernel is its own op; the step
# runs about 2% slower (the graphs save launches: 1707 against 1668 ms, llama3_8b's stage).
NO_GRAPHS = "--xla_gpu_enable_command_buffer="

KINDS = ("matmul", "attention", "copies/slices", "collectives", "elementwise", "other")
_COLLECTIVE = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
               "all-to-all", "all_reduce", "all_gather", "reduce_scatter", "nccl",
               "collective_permute", "send", "recv", "psum", "ppermute", "pmax", "pmin",
               "all_to_all")
_MOVES = ("copy", "dynamic-slice", "dynamic_slice", "dynamic-update-slice",
          "dynamic_update_slice", "transpose", "slice")


def ungraphed(argv: list[str]) -> str:
    """For a tool's `--profile` in `argv`: CUDA graphs off (`NO_GRAPHS` added to
    XLA_FLAGS), so the profile sees every kernel. Must run before JAX starts its GPU
    backend. Returns the line the tool prints beside its timings ("" without --profile)."""
    import os

    if "--profile" not in argv:
        return ""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_GRAPHS}".strip()
    return (f"profiling: CUDA graphs off (XLA_FLAGS {NO_GRAPHS}) so that the profile sees "
            f"each kernel; steps run about 2% slower than with them")


def base_name(op: str) -> str:
    """`loop_dynamic_update_slice_fusion.12` -> `loop_dynamic_update_slice_fusion`
    (and `conditional.2.clone` -> `conditional`)."""
    return re.sub(r"(\.(\d+|clone))+$", "", op)


def kind_of(op: str, target: str = "") -> str:
    """The kind of an HLO op by its name (and, for a custom call, its target from the
    program's text where known)."""
    name, target = base_name(op).lower(), target.lower()
    if "fmha" in name or "cudnn" in target or "flash" in name or "attention" in name:
        return "attention"
    if "gemm" in name or "cublas" in name or "gemm" in target or "cublas" in target or \
            "dot" in name or "matmul" in name or "convolution" in name:
        return "matmul"
    if any(c in name for c in _COLLECTIVE):
        return "collectives"
    if any(m in name for m in _MOVES):
        return "copies/slices"
    if "fusion" in name:
        return "elementwise"
    return "other"


def custom_call_targets(hlo_text: str) -> dict[str, str]:
    """Instruction name -> custom_call_target, from a compiled program's text."""
    found = re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*custom-call\([^\n]*"
                        r"custom_call_target=\"([^\"]+)\"", hlo_text, re.M)
    return {m.group(1): m.group(2) for m in found}


@dataclass
class Breakdown:
    steps: int
    seconds: dict = field(default_factory=dict)  # kind -> seconds per step
    kernels: float = 0.0  # kernels launched per step
    top: list = field(default_factory=list)  # [(op base name, kind, seconds per step)]

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def lines(self, top: int = 10) -> list[str]:
        out = [f"device time per step {self.total * 1e3:.1f} ms, {self.kernels:,.0f} kernels"]
        for kind in KINDS:
            s = self.seconds.get(kind, 0.0)
            out.append(f"  {kind:<14} {s * 1e3:9.1f} ms  {s / max(self.total, 1e-12):6.1%}")
        out.append("  top ops:")
        out += [f"    {name:<48} {kind:<14} {s * 1e3:8.1f} ms" for name, kind, s
                in self.top[:top]]
        return out


def op_events(profile) -> list[tuple[str, float]]:
    """(hlo op, seconds) of every executed op of a `jax.profiler.ProfileData`: the first
    device plane's (one GPU or TPU) where there is one, else the host's (a CPU's thunks:
    with simulated devices, every device's ops together)."""
    planes = list(profile.planes)
    devices = sorted((p for p in planes if p.name.startswith("/device:")
                      and "CUSTOM" not in p.name), key=lambda p: p.name)[:1]
    events = []
    for plane in devices or [p for p in planes if p.name.startswith("/host:CPU")]:
        for line in plane.lines:
            ops = [(e.start_ns, e.duration_ns, str(dict(e.stats)["hlo_op"]))
                   for e in line.events if "hlo_op" in dict(e.stats)]
            events += [(op, ns * 1e-9) for op, ns in _leaves(ops)]
    return events


def _leaves(ops: list[tuple[float, float, str]]) -> list[tuple[str, float]]:
    """(op, ns) of the ops of one timeline line that hold no other op: a loop's or a
    conditional's event spans the ops it runs, which are counted themselves."""
    ops = sorted(ops, key=lambda o: (o[0], -o[1]))  # a container before what it holds
    out = []
    for i, (start, ns, op) in enumerate(ops):
        nested = i + 1 < len(ops) and ops[i + 1][0] < start + ns
        if not nested:
            out.append((op, ns))
    return out


def breakdown(events: list[tuple[str, float]], steps: int,
              targets: dict[str, str] | None = None, top: int = 15) -> Breakdown:
    """Per-step seconds by kind, kernel count and top ops of `steps` profiled steps."""
    targets = targets or {}
    by_kind, by_op = defaultdict(float), Counter()
    for op, seconds in events:
        kind = kind_of(op, targets.get(op, ""))
        by_kind[kind] += seconds / steps
        by_op[base_name(op), kind] += seconds / steps
    ranked = [(name, kind, s) for (name, kind), s in by_op.most_common(top)]
    return Breakdown(steps, dict(by_kind), len(events) / steps, ranked)


def profile_steps(run_step, steps: int, folder: str, hlo_text: str = "") -> Breakdown:
    """Runs `run_step()` `steps` times under `jax.profiler` (writing the trace into
    `folder`) and breaks the device time down (`run_step` must block until done)."""
    import jax
    from jax.profiler import ProfileData

    jax.profiler.start_trace(folder)
    try:
        for _ in range(steps):
            run_step()
    finally:
        jax.profiler.stop_trace()
    traces = sorted(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True))
    events = op_events(ProfileData.from_file(traces[-1])) if traces else []
    return breakdown(events, steps, custom_call_targets(hlo_text))
