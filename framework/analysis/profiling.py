"""The pipeline bubble measured from the devices' own timeline.

A run traces a few steps after warm-up with `jax.profiler` (`profile.steps`,
`profile.start_step`). The trace holds, per device, every executed HLO instruction of
the step with its start and duration (on CPU the XLA client records each simulated
device's thunks, conditionals and while loops included; on GPUs the device's kernels).
The compiled program's text says, for every instruction, which named scope it comes
from (`op_name` metadata), so each event is classified:

  pipeline loop   the tick loop(s) (`pipeline_loop`: one for the tick executor; the
                  forward loop and its autodiff transpose for GPipe/circular), from the
                  first to the last event of an instruction in its body
  stage work      inside a cell's branch: F, B, W or BW (`framework/parallel/pipeline/ticks.py`),
                  or the busy branch of a GPipe/circular tick (`stage_work`; forward in
                  the loop, backward in its transpose)

Per device: bubble = 1 - (time covered by stage work) / (time in the pipeline loops).
Without a pipeline (`parallel.pipeline=1`) the trace is kept but no bubble is derived
(one stage never waits for a neighbour), nor when no stage work is found in it.
What is outside the stage's work inside the loop is the bubble in time: idle ticks,
waiting for a neighbour's message, the sends themselves, the loop's bookkeeping.
`pipeline/bubble_fraction_timed` is the mean over the devices (per pipeline rank in
`summary.json`); `profile/timeline.json` keeps each rank's work intervals for
`tools/schedule_plot.py --trace`.

Simulated CPU devices share the host's cores, so a device "waits" also while the
others run: the timed bubble there shows the schedule's shape (more microbatches idle
less), never accelerator numbers.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np

from framework.analysis import hlo as hlo_lib
from framework.parallel.mesh import PIPE
from framework.parallel.pipeline.kinds import BW, KINDS, F
from framework.parallel.pipeline.program import Program
from framework.parallel.pipeline.scopes import CELL, LOOP

TRACE_DIR = "profile"
TIMELINE_FILE = "timeline.json"
CONTAINERS = ("while", "conditional", "call", "async-start", "async-done")


def classify(hlo: str, schedule) -> tuple[str, dict[str, str], dict[str, str]]:
    """From a compiled program's text: (module name, {instruction: cell kind} for stage
    work, {instruction: which tick loop it runs in}), by the program's structure, not
    by names alone (XLA shortens some instructions' op_name metadata):

      tick loops   the `while` instructions of the `pipeline_loop` scope: "ticks" (the
                   tick executor's), "forward" / "backward" (autodiff's loop and its
                   transpose); every instruction of a computation they call is theirs
      stage work   every instruction of a computation called from the busy branch of
                   a cell's conditional in a loop (`_busy_work`), labelled with its kind:
                   the tick executor's by the branches its dispatch opens
                   (`Program.branches`: a scope -> the kind it runs for)
    Containers (while, conditional, call) are left out of the work: their events on
    CPU time the dispatch, not the content."""
    program = hlo_lib.parse(hlo)
    work, loops = {}, {}
    kinds = _kinds_by_scope(schedule)
    for instrs in program.computations.values():
        for loop in instrs:
            label = _loop_label(loop)
            if label is None:
                continue
            loops[loop.name] = label
            for comp in program.reachable([c for _, c in loop.callees]):
                for inner in program.computations[comp]:
                    loops[inner.name] = label
                    if inner.opcode == "conditional" and inner.op_name.endswith("/cond"):
                        work.update(_busy_work(program, inner, label, kinds))
    return program.module, work, loops


def carried_copies(text: str, share: float = 0.01) -> tuple[int, int]:
    """(bytes of the copies inside a compiled step's tick loop whose shape is one of the
    large buffers the loop carries (`share` of its carry or more), bytes of the carry):
    what the tick executor should never copy (tests/compiled/test_executor.py,
    tools/dispatch_probe.py)."""
    shape, DTYPE_BYTES = hlo_lib.SHAPE, hlo_lib.DTYPE_BYTES
    nbytes = lambda types: sum(DTYPE_BYTES.get(dt, 4) * int(np.prod(
        [int(d) for d in dims.split(",") if d])) for dt, dims in shape.findall(types))
    program = hlo_lib.parse(text)
    loops = [i for instrs in program.computations.values() for i in instrs
             if _loop_label(i) == "ticks"]
    if len(loops) != 1:
        raise ValueError(f"{len(loops)} tick loops in the program, not one")
    carry = nbytes(loops[0].result)
    large = {m.group(0) for m in shape.finditer(loops[0].result)
             if nbytes(m.group(0)) >= carry * share}
    inside = program.reachable([c for _, c in loops[0].callees])
    copies = [i for c in inside for i in program.computations[c] if i.opcode == "copy"]
    first = lambda types: (shape.search(types) or [None])[0]
    return sum(nbytes(i.result) for i in copies if first(i.result) in large), carry


def _loop_label(instr) -> str | None:
    """"ticks", "forward" or "backward" for a tick loop's `while`, else None."""
    parts = instr.op_name.split("/")
    if instr.opcode != "while" or parts[-1] != "while" or len(parts) < 2 or LOOP not in parts[-2]:
        return None
    if "(" not in parts[-2]:
        return "ticks"
    return "backward" if parts[-2].startswith("transpose(") else "forward"


def _kinds_by_scope(schedule) -> dict[str, int]:
    """The tick executor's branch scopes -> the kind each runs for (the head's: F; the
    embedding gradient's: the kind that makes dx), from the branches its dispatch opens."""
    prog = Program(schedule)
    return {} if prog.autodiff else {b.scopes[-1]: b.kind.code for phase in
                                     range(schedule.ticks_per_step) for b in prog.branches(phase)}


def _busy_work(program, cond, label: str, kinds: dict) -> dict[str, str]:
    """{instruction: cell kind} of the busy branch of a cell's conditional: in the tick
    executor by its scope (`kinds`); GPipe/circular's `stage_or_skip` in the `cell`
    scope, F forward and BW backward. Branch 1 is the busy one."""
    scope = cond.op_name.split("/")[-2]
    if label == "ticks":
        kind = kinds.get(scope)
    else:
        kind = (F if label == "forward" else BW) if scope == CELL else None
    if kind is None or len(cond.branches) != 2:
        return {}
    work = {}
    for comp in program.reachable([cond.branches[1]]):
        for leaf in program.computations[comp]:
            if leaf.opcode not in CONTAINERS:
                work[leaf.name] = KINDS[kind].name
    return work


def _union(intervals):
    """Sorted, merged (start, end, kind) intervals (the first kind of a merged run)."""
    out = []
    for start, end, kind in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end), out[-1][2])
        else:
            out.append((start, end, kind))
    return out


def _events(xplane: str, module: str):
    """(device ordinal, run id, start ns, end ns, instruction) of the step's events."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane)
    for plane in data.planes:
        gpu = re.search(r"/device:GPU:(\d+)", plane.name)
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                op = stats.get("hlo_op")
                if op is None or stats.get("hlo_module", module) != module:
                    continue
                ordinal = stats.get("device_ordinal", int(gpu.group(1)) if gpu else None)
                if ordinal is None:
                    continue
                run = stats.get("run_id", 0)
                yield int(ordinal), run, event.start_ns, event.start_ns + event.duration_ns, op


def timeline(xplane: str, hlo: str, device_rank: dict[int, int], schedule) -> dict:
    """Per profiled step and device: work intervals and the bubble; see the module
    docstring. device_rank: device ordinal -> pipeline rank."""
    module, work, loops = classify(hlo, schedule)
    per = defaultdict(lambda: {"loops": {}, "work": []})
    for ordinal, run, start, end, op in _events(xplane, module):
        if ordinal not in device_rank or op not in loops:
            continue
        entry = per[run, ordinal]
        first, last = entry["loops"].get(loops[op], (start, end))
        entry["loops"][loops[op]] = (min(first, start), max(last, end))
        if op in work:
            entry["work"].append((start, end, work[op]))
    steps = []
    for run in sorted({run for run, _ in per}):
        devices = {}
        for ordinal in sorted(device_rank):
            entry = per.get((run, ordinal))
            if not entry or not entry["loops"]:
                continue
            loops_iv = _union([(s, e, "") for s, e in entry["loops"].values()])
            span = sum(e - s for s, e, _ in loops_iv)
            merged = _union(entry["work"])
            busy = sum(e - s for s, e, _ in merged)
            devices[ordinal] = {"span_ns": span, "busy_ns": busy, "origin": loops_iv[0][0],
                                "intervals": merged, "bubble": 1 - busy / span if span else 0.0}
        if devices:
            steps.append(devices)
    return {"steps": steps}


def summarize(raw: dict, device_rank: dict[int, int], n_ranks: int) -> dict:
    """Bubble per rank and overall (mean over profiled steps and devices), and each
    rank's first device's work intervals (ms from its loop's start) per step."""
    per_rank = [[] for _ in range(n_ranks)]
    steps_out = []
    for devices in raw["steps"]:
        shown, ranks = {}, [[] for _ in range(n_ranks)]
        for ordinal, d in devices.items():
            rank = device_rank[ordinal]
            per_rank[rank].append(d["bubble"])
            if rank not in shown:
                shown[rank] = ordinal
                ranks[rank] = [[(s - d["origin"]) / 1e6, (e - d["origin"]) / 1e6, k]
                               for s, e, k in d["intervals"]]
        steps_out.append({"ranks": ranks,
                          "devices": ",".join(str(shown.get(r, "-")) for r in range(n_ranks))})
    by_rank = [float(np.mean(b)) if b else float("nan") for b in per_rank]
    every = [b for bs in per_rank for b in bs]
    return {"bubble_timed": float(np.mean(every)) if every else float("nan"),
            "bubble_timed_per_rank": by_rank, "steps": steps_out}


def profile_steps(steps: int, start_step: int, first_done: int, last: int) -> tuple | None:
    """(first, last) step numbers to trace, or None: `steps` steps from `start_step`,
    moved earlier to fit before `last`, never before the second step of this
    invocation (`first_done` + 2; its first step includes one-off costs)."""
    if steps < 1:
        return None
    first = max(start_step, first_done + 2)
    if first + steps - 1 > last:
        first = last - steps + 1
    return (first, first + steps - 1) if first >= first_done + 2 else None


class Profiler:
    """Traces the steps between `start()` and `stop()` (process 0's devices), writes
    `<run_dir>/profile/timeline.json` and returns the timed bubble (mean and per rank).
    The raw trace (`profile/plugins/profile/...xplane.pb`, for TensorBoard / XProf) is
    kept if the profile folder is at most `keep_trace_mb` MB."""

    def __init__(self, engine, run_dir: Path, keep_trace_mb: float):
        self.engine, self.keep_trace_mb = engine, keep_trace_mb
        self.out = Path(run_dir) / TRACE_DIR

    def start(self) -> None:
        import jax

        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir(parents=True)
        # No Python tracer: the bubble is read from the devices' ops, and the tracer's
        # start hooks every Python thread, which crashed the process (SIGSEGV in
        # SetProfilerInAllThreads, jaxlib 0.10.2) when a thread, here a checkpoint
        # save failing on a full disk, was exiting at that moment.
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        jax.profiler.start_trace(str(self.out), profiler_options=options)

    def stop(self) -> dict:
        """Stops tracing (the caller waited for the steps) and analyses the trace. A trace
        that cannot be written (a full disk) gives no numbers rather than an error: the
        profile is an extra, the run goes on."""
        import jax

        try:
            jax.profiler.stop_trace()
        except Exception:  # JaxRuntimeError RESOURCE_EXHAUSTED: no space for the trace
            shutil.rmtree(self.out, ignore_errors=True)
            return {}
        files = glob.glob(str(self.out / "**" / "*.xplane.pb"), recursive=True)
        if not files:
            return {}
        engine, mesh = self.engine, self.engine.mesh
        if mesh.shape[PIPE] == 1:  # one stage: no device waits for a neighbour
            return {}
        device_rank = {}
        for index, device in np.ndenumerate(mesh.devices):  # index[0]: the pipe rank
            if device.process_index == jax.process_index():
                device_rank[int(getattr(device, "local_hardware_id", device.id))] = int(index[0])
        raw = timeline(files[0], engine.compiled.as_text(), device_rank, engine.schedule)
        if not any(d["intervals"] for devices in raw["steps"] for d in devices.values()):
            return {}  # no stage work found in the trace: no number rather than 100%
        result = summarize(raw, device_rank, mesh.shape[PIPE])
        par = engine.parallel
        record = {"schedule": {"name": par.schedule, "pipeline": par.pipeline,
                               "microbatches": par.microbatches,
                               "virtual_stages": par.virtual_stages,
                               "overlap_sends": engine.schedule.overlap,
                               "parts": engine.schedule.parts},
                  "platform": mesh.devices.flat[0].platform,
                  "bubble_table": engine.schedule.bubble_fraction,
                  "bubble_formula": engine.schedule.formula_bubble, **result}
        try:
            (self.out / TIMELINE_FILE).write_text(json.dumps(record) + "\n")
        except OSError:
            pass  # a full disk: the numbers still reach metrics.jsonl
        size = sum(os.path.getsize(f) for f in glob.glob(str(self.out / "**" / "*"), recursive=True)
                   if os.path.isfile(f))
        if size > self.keep_trace_mb * 2**20:
            shutil.rmtree(self.out / "plugins", ignore_errors=True)
        return {"pipeline/bubble_fraction_timed": result["bubble_timed"],
                "pipeline/bubble_fraction_timed_per_rank": result["bubble_timed_per_rank"]}


def measure(engine, run_steps, run_dir: Path, keep_trace_mb: float = 50.0) -> dict:
    """Profiles what `run_steps()` runs (it must wait for its steps): see `Profiler`."""
    profiler = Profiler(engine, run_dir, keep_trace_mb)
    profiler.start()
    try:
        run_steps()
    finally:
        result = profiler.stop()
    return result
