"""Bytes a compiled step moves without computing: copies, and dynamic slices and updates
(the pipeline's stash written into and read out of the tick loop's carried buffers,
the layer scan's weights sliced per layer), per step, read from the compiled program.

Each instruction counts the bytes it writes: a copy its result, a dynamic-slice its
result (the slice), a dynamic-update-slice its update (the buffer itself is updated in
place); times how often its computation runs per step (a while body x its trip count:
`hlo.Program.multipliers`). A fusion is counted through its fused computation, so a
`loop_dynamic_update_slice_fusion` counts the update it writes. Both branches of a
conditional count as if run every time: an upper bound where a branch is idle (the tick
executor's cells on the ticks they do not run). `framework.compile` reports these
(`traffic/*`); what they cost on a GPU is the profile's `copies/slices`
(framework/analysis/device_time.py).
"""

from __future__ import annotations

from framework.analysis import hlo

_SHAPE, _BYTES = hlo.SHAPE, hlo.DTYPE_BYTES
KINDS = {"copy": "copied", "dynamic-slice": "sliced", "dynamic-update-slice": "updated"}


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
    for factor, types, instr in hlo.executed(hlo.parse(text)):
        kind = KINDS.get(instr.opcode)
        if kind is None:
            continue
        if kind == "updated":  # the update written, the buffer updated in place
            update = hlo.operands(instr)[1:2]
            nbytes = type_bytes(types.get(update[0], "")) if update else 0
        else:
            nbytes = type_bytes(instr.result)
        out[kind] += factor * nbytes
    return out
