"""Communication audit: every collective in a compiled program, by mesh axis.

Reads the post-optimisation HLO text (`compiled.as_text()`), finds each all-reduce,
all-gather, reduce-scatter, collective-permute and all-to-all (also their async
`-start` forms), works out which mesh axes its replica groups span, how many times it
runs per step (while loops multiply by their known trip count) and how many bytes it
moves.

Bytes are *sent per device*, averaged over all devices of the mesh, for the usual ring
algorithms on a group of n devices and a per-device buffer of S bytes:
    all-reduce 2(n-1)/n*S    all-gather (n-1)/n*S_out    reduce-scatter (n-1)*S_out
    all-to-all (n-1)/n*S     collective-permute S, by the devices that send.
A ragged-all-to-all (the dropless expert exchange on TPUs and GPUs,
framework/parallel/expert.py) sends a data-dependent share of its operand: counted as
the balanced expectation, (n-1)/n of the copies, S the smaller of its operand and its
result (the other is the receive buffer of the worst case, n times the copies), as
framework/analysis/comm_model.py's `expert_bytes` counts it.
A collective over several axes is split between them as a hierarchical ring would
(one pass per axis), so the per-axis totals add up. On GPUs, the collectives that
overlap a matmul are marked (framework/analysis/overlap.py's rule) and weighed per axis
(`overlapped_fraction`, `sends_overlapped_fraction`).

A static program cannot say how often a branch of a conditional runs. The engine wraps
work that only some ranks or ticks do in named scopes (the embedding on the first
pipeline rank, the 1F1B forward and backward branches, ...) and passes `scope_weights`:
the fraction of devices x executions on which that scope actually runs, taken from its
schedule table. A collective inside such scopes counts that fraction of its runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from framework.analysis import hlo as hlo_lib
from framework.analysis.overlap import overlapped_names

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
         "ragged-all-to-all")
DTYPE_BYTES, _SHAPE = hlo_lib.DTYPE_BYTES, hlo_lib.SHAPE


@dataclass
class Collective:
    kind: str
    axes: tuple[str, ...]  # mesh axes the groups span, e.g. ("tensor",)
    # per-device result buffers (dtype, shape); a ragged-all-to-all's copies (`_copies`)
    shapes: list[tuple[str, tuple[int, ...]]]
    executions: float  # per step, averaged over devices (loop trips x scope weights)
    group_size: int
    senders: float  # fraction of devices that send (1 except for permutes)
    pairs: list[tuple[int, int]] | None  # collective-permute source -> target
    name: str  # the HLO instruction
    op_name: str = ""  # the JAX operation it came from (metadata), e.g. ".../Block/attn/..."
    overlapped: bool = False  # asynchronous, with compute scheduled before its done (GPU)

    @property
    def buffer_bytes(self) -> int:
        return sum(DTYPE_BYTES.get(dt, 4) * int(np.prod(shape)) for dt, shape in self.shapes)

    def bytes_per_execution(self) -> float:
        """Bytes one (average) device sends each time this collective runs."""
        n, s = self.group_size, self.buffer_bytes
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * s
        if self.kind in ("all-gather", "all-to-all", "ragged-all-to-all"):
            return (n - 1) / n * s
        if self.kind == "reduce-scatter":
            return (n - 1) * s
        return s * self.senders  # collective-permute

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_per_execution() * self.executions


def _parse_groups(line: str, n_devices: int) -> list[list[int]] | None:
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:  # iota form: reshape(transpose(reshape(iota, dims), perm), groups)
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                  r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", line)
    if m:  # mesh form: groups vary along the named (reshaped) mesh axes
        names = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        sizes = [int(s) for _, s in names]
        ids = np.arange(n_devices)
        if m.group(2):
            ids = ids.reshape([int(x) for x in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape(sizes)
        axes = [i for i, (n, _) in enumerate(names) if f"'{n}'" in m.group(4)]
        rest = [i for i in range(len(sizes)) if i not in axes]
        ids = ids.transpose(rest + axes).reshape(-1, int(np.prod([sizes[i] for i in axes])))
        return ids.tolist()
    return None


def _axes_of(group: list[int], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    coords = np.array(np.unravel_index(group, tuple(mesh_shape.values()))).T
    return tuple(a for i, a in enumerate(mesh_shape) if len(set(coords[:, i])) > 1)


def _async_results(kind: str, shapes: list) -> list:
    """The result buffers of an async `-start`: all-reduce-start returns the results;
    the others return (operands, results[, context scalars]): the second half."""
    if kind == "all-reduce":
        return shapes
    buffers = [s for s in shapes if s[1] or s[0] not in ("u32", "s32")]
    return buffers[len(buffers) // 2:]


def _copies(result: list, operand_type: str) -> list:
    """A ragged-all-to-all's copies: the smaller of its result buffers and its operand
    (`operand_type`, its HLO type text): the dispatch's operand, the combine's result.
    An async start's offsets and sizes (integer vectors, GPU) are not copies."""
    rows = [(dt, s) for dt, s in result if len(s) > 1 or dt not in ("s32", "s64", "u32")]
    result = rows or result
    operand = [(dt, tuple(int(d) for d in dims.split(",") if d))
               for dt, dims in _SHAPE.findall(operand_type) if dt in DTYPE_BYTES][:1]
    size = lambda shapes: sum(DTYPE_BYTES.get(dt, 4) * int(np.prod(s)) for dt, s in shapes)
    return operand if operand and size(operand) < size(result) else result


def collectives(hlo: str, mesh_shape: dict[str, int],
                scope_weights: dict[str, float] | None = None) -> list[Collective]:
    """All collectives of a compiled program. mesh_shape: {'pipe': 2, 'data': 2, ...} in
    mesh order; device i of the program is mesh.devices.flat[i]."""
    n = int(np.prod(list(mesh_shape.values())))
    program = hlo_lib.parse(hlo)
    mult, runs_of = program.multipliers(), program.runs(scope_weights)
    hidden = overlapped_names(program)
    found = []
    for comp, instrs in program.computations.items():
        if mult.get(comp, 0) == 0:
            continue
        types = {i.name: i.result for i in instrs}
        for instr in instrs:
            op, line = instr.opcode, instr.line
            kind = op[:-6] if op.endswith("-start") else op
            if kind not in KINDS:
                continue
            shapes = [(dt, tuple(int(d) for d in dims.split(",") if d))
                      for dt, dims in _SHAPE.findall(instr.result) if dt in DTYPE_BYTES]
            if op.endswith("-start"):
                shapes = _async_results(kind, shapes)
            if kind == "ragged-all-to-all":
                shapes = _copies(shapes, types.get(hlo_lib.operands(instr)[0], ""))
            pairs = None
            if kind == "collective-permute":
                pm = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
                pairs = [tuple(map(int, p.split(","))) for p in re.findall(r"\{(\d+,\d+)", pm.group(0))] if pm else []
                groups = [list(p) for p in pairs]
                senders = len({a for a, _ in pairs}) / n
                size = 2
            else:
                groups = _parse_groups(line, n) or [list(range(n))]
                size = len(groups[0])
                senders = sum(len(g) for g in groups if len(g) > 1) / n
            axes = tuple(sorted({a for g in groups for a in _axes_of(g, mesh_shape)},
                                key=list(mesh_shape).index))
            op_name = program.scoped_name(comp, instr)
            runs = runs_of(comp, instr)
            found.append(Collective(kind, axes, shapes, runs, size, senders, pairs, instr.name,
                                    op_name, instr.name in hidden))
    return found


def bytes_per_axis(found: list[Collective], mesh_shape: dict[str, int]) -> dict[str, float]:
    """Bytes sent per device per step, by mesh axis (multi-axis collectives split)."""
    out = {a: 0.0 for a in mesh_shape}
    for c in found:
        if not c.axes:
            continue
        if len(c.axes) == 1 or c.kind == "collective-permute":
            share = {a: 1 / len(c.axes) for a in c.axes}
            for a in c.axes:
                out[a] += c.bytes_per_step * share[a]
            continue
        for a in c.axes:  # one ring pass per axis, on the full buffer
            n = mesh_shape[a]
            per = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": (n - 1) / n}.get(c.kind, (n - 1) / n)
            out[a] += per * c.buffer_bytes * c.executions * c.senders
    return out


def sends_overlapped_fraction(found: list[Collective], axis: str = "pipe") -> float | None:
    """The share of the point-to-point bytes over `axis` (`collective-permute`s: the
    pipeline's stage-to-stage sends over `pipe`, the ring attention's over `context`)
    sent by overlapping permutes (None when there are none)."""
    sends = [c for c in found if c.kind == "collective-permute" and axis in c.axes]
    total = sum(c.bytes_per_step for c in sends)
    return sum(c.bytes_per_step for c in sends if c.overlapped) / total if total else None


def exchange_overlapped_fraction(found: list[Collective]) -> float | None:
    """The share of the expert exchange's bytes (the MoE layers' dispatch and combine
    all-to-alls over `expert`; without FSDP's gathers and reduce-scatters, which cross
    the same devices when the expert groups are the data devices) sent by overlapping
    collectives (None when there are none)."""
    sends = [c for c in found if c.kind in ("all-to-all", "ragged-all-to-all")
             and "expert" in c.axes]
    total = sum(c.bytes_per_step for c in sends)
    return sum(c.bytes_per_step for c in sends if c.overlapped) / total if total else None


def overlapped_fraction(found: list[Collective], mesh_shape: dict[str, int]) -> dict[str, float | None]:
    """Per mesh axis: the share of its bytes per step sent by overlapping collectives
    (None for an axis that sends nothing)."""
    total = bytes_per_axis(found, mesh_shape)
    hidden = bytes_per_axis([c for c in found if c.overlapped], mesh_shape)
    return {a: (hidden[a] / total[a] if total[a] else None) for a in mesh_shape}


def report(found: list[Collective]) -> str:
    """A human-readable table, one row per collective."""
    rows = [f"{'kind':<19}{'axes':<16}{'runs':>6}{'buffer':>12}{'bytes/step':>14}  shapes"]
    for c in sorted(found, key=lambda c: (-c.bytes_per_step, c.kind)):
        shapes = ", ".join(f"{dt}{list(s)}" for dt, s in c.shapes[:3])
        if len(c.shapes) > 3:
            shapes += f", ... ({len(c.shapes)} buffers)"
        rows.append(f"{c.kind:<19}{'+'.join(c.axes) or '-':<16}{c.executions:>6.4g}"
                    f"{c.buffer_bytes:>12,}{c.bytes_per_step:>14,.0f}  {shapes}")
    return "\n".join(rows)


# --- What a compiled step says about itself --------------------------------------------

def step_collectives(hlo: str, mesh_shape: dict[str, int], program) -> list[Collective]:
    """The communication audit of a compiled train step on a mesh of `mesh_shape`
    running the pipeline `program`, whose scope weights say how often the conditionally
    executed scopes run (`framework/parallel/pipeline/program.py`)."""
    return collectives(hlo, mesh_shape, program.scope_weights)


def engine_collectives(engine, hlo: str) -> list[Collective]:
    """The communication audit of a compiled step of `engine` (framework/engine/build.py)."""
    return step_collectives(hlo, dict(engine.mesh.shape), engine.program)


def step_stats(engine, state, tokens) -> dict:
    """Compiles `engine`'s step for these inputs (arrays or ShapeDtypeStructs; later
    steps reuse the program) and returns what the program says about itself: compile
    time, per-device memory, bytes per mesh axis (`compiled_stats`)."""
    seconds = engine.compile(state, tokens)
    return {"perf/compile_time_s": seconds,
            **compiled_stats(engine.compiled, dict(engine.mesh.shape), engine.program)}


def compiled_stats(compiled, mesh_shape: dict[str, int], program) -> dict:
    """Per-device memory (XLA's memory analysis) and bytes sent per device per step on
    each mesh axis (the communication audit) of a compiled train step."""
    stats = {}
    mem = compiled.memory_analysis()
    if mem is not None:
        # Arguments + outputs + temporaries, donated (aliased) buffers counted once:
        # everything XLA's buffer assignment holds at the step's high-water mark.
        stats["memory/peak_bytes_per_device"] = int(
            mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
        stats["memory/temp_bytes_per_device"] = int(mem.temp_size_in_bytes)
        stats["memory/argument_bytes_per_device"] = int(mem.argument_size_in_bytes)
    found = step_collectives(compiled.as_text(), mesh_shape, program)
    for axis, nbytes in bytes_per_axis(found, mesh_shape).items():
        stats[f"comm/bytes_per_step/{axis}"] = float(nbytes)
    return stats
