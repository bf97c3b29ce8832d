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
conditional count as if run every time, an upper bound where a branch is idle, unless
the pipeline's `scope_weights` are given: then each branch of the tick executor's
conditionals counts as often as the schedule's table runs it, the work's w of the ticks
and the idle ranks' pass-through 1 - w (`hlo.Program.runs`; since 2026-12-02, what
`framework.compile` reads). `framework.compile` reports these
(`traffic/*`); what they cost on a GPU is the profile's `copies/slices`
(framework/analysis/device_time.py).

`accessed_bytes` is the whole program's traffic by the same reading: every kernel's
reads and writes per step (a fusion's inputs and outputs, a library call's operands
and result, a collective's), with a fused parameter that is only sliced read as its
slices and a buffer updated in place written as its update; the measure of a change
that moves no FLOP (docs/performance.md, "Weights made once a step"). A buffer both
sliced and updated in place by one kernel (a gradient accumulator's chunk read, added
to and written back: `a.at[chunk].add(u)`) reads its slices and writes its update, and
a scatter in place (the embedding's gradient into its table) reads and writes the
rows it updates (its updates' bytes), not the buffer: until 2026-12-03 both counted
the whole buffer, read and written (docs/performance.md, "What the traffic counts").
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


def moved_bytes(text: str, scope_weights=None) -> dict[str, float]:
    """Bytes per step by kind (`copied`, `sliced`, `updated`) of a compiled program;
    `scope_weights`: a pipeline's branches as often as its table runs them
    (`hlo.Program.runs`)."""
    out = dict.fromkeys(KINDS.values(), 0.0)
    program = hlo.parse(text)
    fused = hlo.fused(program)
    slicing = {c for c in fused if any(i.opcode in _SLICING for i in program.computations[c])}
    in_place = {i.name for c in fused for i in program.computations[c]  # (names: unique)
                if i.opcode == "dynamic-slice" and i.name not in _written_out(program, c)}
    for factor, types, instr in hlo.executed(program, scope_weights=scope_weights):
        kind = KINDS.get(instr.opcode)
        if kind == "updated":  # the update written, the buffer updated in place
            update = hlo.operands(instr)[1:2]
            out[kind] += factor * (type_bytes(types.get(update[0], "")) if update else 0)
        elif kind == "sliced" and instr.name not in in_place:
            out[kind] += factor * type_bytes(instr.result)
    for factor, _, instr in hlo.executed(program, slicing, scope_weights):  # own copies
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


def accessed_bytes(text: str, scope_weights=None, scope: str | None = None) -> float:
    """Bytes every kernel of a compiled program reads and writes, per step
    (`scope_weights`: as `moved_bytes`'); with `scope`, only the kernels made of
    operations inside that named scope (a fusion: any of its instructions)."""
    return accessed_by_scope(text, scope_weights, () if scope is None else (scope,))[scope]


def accessed_by_scope(text: str, scope_weights=None, scopes: tuple = ()) -> dict:
    """`accessed_bytes` of the whole program (key None) and of each named scope in
    `scopes`, from one reading of the program."""
    program = hlo.parse(text)
    out = dict.fromkeys((None, *scopes), 0.0)
    for factor, types, instr in hlo.kernels(program, scope_weights):
        callee = dict(instr.callees).get("calls") if instr.opcode == "fusion" else None
        nbytes = factor * (_fusion_bytes(program, callee) if callee else
                           _kernel_bytes(instr, types))
        for scope in out:
            if scope is None or _in_scope(program, instr, callee, scope):
                out[scope] += nbytes
    return out


def _in_scope(program: hlo.Program, instr: hlo.Instruction, callee, scope: str) -> bool:
    """Whether a kernel holds an operation of the named scope `scope` (op_name
    `.../scope/...`): the instruction's own, or one its fusion computes."""
    inside = lambda i: f"/{scope}/" in f"/{i.op_name}"
    return inside(instr) or (callee is not None and
                             any(map(inside, program.computations[callee])))


def _kernel_bytes(instr: hlo.Instruction, types: dict) -> int:
    """An unfused instruction's reads and writes: its operands and result (a library
    call's first output, not its workspace; an async start's result less its inputs;
    a slice or an update: the slice's bytes, read and written)."""
    args = [type_bytes(types.get(n, "")) for n in hlo.operands(instr)]
    if instr.opcode == "dynamic-update-slice":
        return 2 * (args[1] if len(args) > 1 else 0)
    if instr.opcode == "dynamic-slice":
        return 2 * type_bytes(instr.result)
    result = type_bytes(instr.result)
    if instr.opcode == "custom-call" and _SHAPE.search(instr.result):
        result = type_bytes(_SHAPE.search(instr.result).group(0))  # (its workspace: not)
    elif instr.opcode.endswith("-start"):
        result = max(result - sum(args), 0)
    return sum(args) + result


def _fusion_bytes(program: hlo.Program, comp: str) -> int:
    """One fusion's reads and writes: each parameter whole, or the slices taken of it
    where it is only sliced, or nothing where it is only updated in place; each output
    (a multi-output fusion's parts), or the update written where it is an in-place
    update of a buffer (through bitcasts and copies)."""
    instrs = {i.name: i for i in program.computations[comp]}
    uses: dict = {}
    for instr in instrs.values():
        for k, name in enumerate(hlo.operands(instr)):
            uses.setdefault(name, []).append((instr, k))
    read = 0
    for instr in instrs.values():
        if instr.opcode != "parameter":
            continue
        at = _uses(uses, instr.name)
        if at and all(k == 0 and u.opcode in _IN_PLACE for u, k in at):
            read += sum(type_bytes(u.result) if u.opcode == "dynamic-slice" else
                        _scattered(instrs, u) if u.opcode == "scatter" else 0 for u, _ in at)
        else:
            read += type_bytes(instr.result)
    return read + sum(_written(instrs, name) for name in hlo.outputs(instrs))


# What a fused kernel does to a buffer in place (its operand 0): reads a slice, writes
# an update, or scatters updates into it (reading and writing the rows they touch)
_IN_PLACE = ("dynamic-slice", "dynamic-update-slice", "scatter")


def _scattered(instrs: dict, scatter: hlo.Instruction) -> int:
    """Bytes of a scatter's updates (one operand, its indices, its updates), the rows of
    the buffer it reads and writes in place; a variadic scatter: its whole result."""
    args = hlo.operands(scatter)
    if len(args) != 3 or args[2] not in instrs:
        return type_bytes(scatter.result)
    return type_bytes(instrs[args[2]].result)


def _uses(uses: dict, name: str) -> list:
    """(instruction, operand index) of every use of `name`, looking through bitcasts
    (a view: the slice of a bitcast stack reads only the slice)."""
    found = []
    for instr, k in uses.get(name, []):
        found += _uses(uses, instr.name) if instr.opcode == "bitcast" else [(instr, k)]
    return found


def _written(instrs: dict, name: str) -> int:
    """Bytes an output of a fusion writes: an in-place update's update, else itself."""
    instr = instrs[name]
    while instr.opcode in ("bitcast", "copy") and hlo.operands(instr)[0] in instrs:
        instr = instrs[hlo.operands(instr)[0]]
    if instr.opcode == "dynamic-update-slice":
        update = hlo.operands(instr)[1]
        return type_bytes(instrs[update].result) if update in instrs else 0
    if instr.opcode == "scatter" and _is_parameter(instrs, hlo.operands(instr)[0]):
        return _scattered(instrs, instr)  # (into a buffer of its own: written whole)
    return type_bytes(instrs[name].result)


def _is_parameter(instrs: dict, name: str) -> bool:
    """Whether `name` is a fused computation's parameter (through bitcasts)."""
    while name in instrs and instrs[name].opcode == "bitcast":
        name = hlo.operands(instrs[name])[0]
    return name in instrs and instrs[name].opcode == "parameter"
