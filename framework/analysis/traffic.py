"""Bytes a compiled step moves without computing: copies, and dynamic slices and updates
(the pipeline's stash written into and read out of the tick loop's carried buffers,
the layer scan's weights sliced per layer), per step, read from the compiled program.

Each instruction counts the bytes it writes: a copy its result, a dynamic-slice its
result (the slice), a dynamic-update-slice its update (the buffer itself is updated in
place); times how often its computation runs per step (a while body x its trip count:
`hlo.Program.multipliers`). A fusion is counted through its fused computation, so a
`loop_dynamic_update_slice_fusion` counts the update it writes. A copy fused with a
slice or an update (the GPU compiler's `dynamic_slice_fusion` kernels: the slice
materialized, the update written) is the same bytes in the same kernel, counted once,
as sliced or updated; `copied` is the copies that are passes of their own. A slice
fused into the kernel that reads it (an elementwise fusion starting from a layer's
stacked residual) writes nothing: `sliced` is the slices written out. (Until
2026-11-30 both counted every such instruction: docs/performance.md, "What the traffic
counts".) Both branches of a
conditional count as if run every time: an upper bound where a branch is idle (the tick
executor's cells on the ticks they do not run). `framework.compile` reports these
(`traffic/*`); what they cost on a GPU is the profile's `copies/slices`
(framework/analysis/device_time.py).
"""

from __future__ import annotations

from framework.analysis import hlo

_SHAPE, _BYTES = hlo.SHAPE, hlo.DTYPE_BYTES
KINDS = {"copy": "copied", "dynamic-slice": "sliced", "dynamic-update-slice": "updated"}
_SLICING = ("dynamic-slice", "dynamic-update-slice")


def type_bytes(text: str) -> int:
    """Bytes of every array in a result type (a tuple's parts summed)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES.get(dtype, 4)
    return total


def moved_bytes(text: str) -> dict[str, float]:
    """Bytes per step by kind (`copied`, `sliced`, `updated`) of a compiled program."""
    out = dict.fromkeys(KINDS.values(), 0.0)
    program = hlo.parse(text)
    fused = hlo.fused(program)
    slicing = {c for c in fused if any(i.opcode in _SLICING for i in program.computations[c])}
    in_place = {i.name for c in fused for i in program.computations[c]  # (names: unique)
                if i.opcode == "dynamic-slice" and i.name not in _written_out(program, c)}
    for factor, types, instr in hlo.executed(program):
        kind = KINDS.get(instr.opcode)
        if kind == "updated":  # the update written, the buffer updated in place
            update = hlo.operands(instr)[1:2]
            out[kind] += factor * (type_bytes(types.get(update[0], "")) if update else 0)
        elif kind == "sliced" and instr.name not in in_place:
            out[kind] += factor * type_bytes(instr.result)
    for factor, _, instr in hlo.executed(program, skip=slicing):  # copies of their own
        if instr.opcode == "copy":
            out["copied"] += factor * type_bytes(instr.result)
    return out


def _written_out(program: hlo.Program, comp: str) -> set[str]:
    """What a fused computation writes out: its root (a multi-output fusion's parts),
    and what those are bitcasts or copies of. A slice that is not among them is read
    where it lies by the kernel it is fused into."""
    instrs = {i.name: i for i in program.computations[comp]}
    todo = [i for i in instrs.values() if i.line.lstrip().startswith("ROOT ")]
    out = set()
    while todo:
        instr = todo.pop()
        out.add(instr.name)
        if instr.opcode in ("tuple", "bitcast", "copy"):
            todo += [instrs[n] for n in hlo.operands(instr) if n in instrs]
    return out
