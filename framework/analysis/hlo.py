"""Reading a compiled program's text (`compiled.as_text()`, post-optimisation HLO): its
computations, their instructions, which computation calls which and how often. The
communication audit (`framework/analysis/audit.py`) and the profiler's classification
of events (`framework/analysis/profiling.py`) both read programs through here.

An instruction line looks like

    %name = f32[8,128]{1,0} opcode(%a, %b), replica_groups=..., body=%comp,
        backend_config={"known_trip_count":{"n":"12"}}, metadata={op_name="jit(f)/..."}

and a computation is the block between `name (...) -> ... {` and `}`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property

_COMP_START = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z\-]+)\((.*)$")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)"
                     r"=\{?%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MODULE = re.compile(r"^HloModule ([\w.\-]+)")
# An array type, e.g. f32[8,128], pred[], f8e4m3fn[4096,1024]: (element type, dims). The
# FP8 types carry an exponent/mantissa suffix that `[a-z]+[0-9]+` alone never matched
# (the audit and the traffic counts missed every FP8 array before 2026-11-28).
SHAPE = re.compile(r"\b(pred|[a-z]+[0-9]+(?:e[0-9]m[0-9][a-z0-9]*)?)\[([0-9,]*)\]")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
               "f8e4m3fn": 1, "f8e5m2": 1}


@dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str  # e.g. all-reduce, all-reduce-start, while, conditional, fusion
    result: str  # the result type text, e.g. "f32[8,128]{1,0}" or a tuple
    line: str  # the whole line (operands and attributes)
    op_name: str  # the JAX operation it came from (metadata), "" if none
    callees: tuple[tuple[str, str], ...]  # (attribute, computation): body, calls, ...
    branches: tuple[str, ...]  # a conditional's branch computations, in branch order
    trip_count: int | None  # a while loop's known trip count


def parse_instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if not m:
        return None
    op_name = _OP_NAME.search(line)
    branches = _BRANCHES.search(line)
    trip = _TRIP.search(line)
    return Instruction(
        m.group(1), m.group(3), m.group(2), line, op_name.group(1) if op_name else "",
        tuple(_CALLEE.findall(line)),
        tuple(b.strip().lstrip("%") for b in branches.group(1).split(",")) if branches else (),
        int(trip.group(1)) if trip else None)


def split_computations(hlo: str) -> dict[str, list[str]]:
    """computation name -> its lines; "__entry__" -> [the entry computation's name]."""
    comps, current = {}, None
    for line in hlo.splitlines():
        m = _COMP_START.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = [current]
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps


@dataclass(frozen=True)
class Program:
    module: str  # the HloModule's name
    entry: str  # the entry computation
    computations: dict  # name -> [Instruction, ...]

    def reachable(self, roots) -> set[str]:
        """The computations `roots` call, directly or not, and the roots themselves."""
        seen, todo = set(), list(roots)
        while todo:
            comp = todo.pop()
            if comp in seen or comp not in self.computations:
                continue
            seen.add(comp)
            for instr in self.computations[comp]:
                todo += [c for _, c in instr.callees] + list(instr.branches)
        return seen

    def op_name_of(self, comp: str, instr: Instruction, depth: int = 4) -> str:
        """The instruction's op_name, or for one the compiler made without metadata
        (e.g. the GPU compiler's combined all-reduces) that of its nearest operand that
        has one: the JAX scope its data comes from."""
        if instr.op_name or depth == 0:
            return instr.op_name
        by_name = {i.name: i for i in self.computations.get(comp, ())}
        args = instr.line.split(f" {instr.opcode}(", 1)[-1].split(")", 1)[0]
        for operand in re.findall(r"%([\w.\-]+)", args):
            if operand in by_name:
                found = self.op_name_of(comp, by_name[operand], depth - 1)
                if found:
                    return found
        return ""

    def scoped_name(self, comp: str, instr: Instruction) -> str:
        """`op_name_of`, or where that is empty the op_name of the nearest instruction
        that calls the instruction's computation (a fusion, a conditional's branch: the
        GPU and CPU compilers leave e.g. the weight gradients' dots of a split
        backward's W without metadata, inside its named conditional)."""
        name, seen = self.op_name_of(comp, instr), set()
        while not name and comp in self._callers and comp not in seen:
            seen.add(comp)
            comp, caller = self._callers[comp]
            name = self.op_name_of(comp, caller)
        return name

    @cached_property
    def _callers(self) -> dict[str, tuple[str, Instruction]]:
        """computation -> (the computation, the instruction) that first calls it."""
        out = {}
        for comp, instrs in self.computations.items():
            for instr in instrs:
                for callee in [c for _, c in instr.callees] + list(instr.branches):
                    out.setdefault(callee, (comp, instr))
        return out

    def trip_count(self, loop: Instruction) -> int | None:
        """A while loop's trip count: XLA's `known_trip_count` where the compiler wrote
        it (CPU, GPU); else read from the condition, `counter < constant` (the TPU
        compiler writes none), for JAX's loops, whose counter starts at 0 and steps by 1."""
        if loop.trip_count:
            return loop.trip_count
        cond = dict(loop.callees).get("condition")
        instrs = self.computations.get(cond, ())
        root = next((i for i in instrs if i.line.lstrip().startswith("ROOT ")), None)
        if root is None or root.opcode != "compare" or "direction=LT" not in root.line:
            return None
        constants = {i.name: i.line for i in instrs if i.opcode == "constant"}
        for operand in re.findall(r"%([\w.\-]+)", root.line.split("compare(", 1)[1].split(")")[0]):
            m = re.search(r"constant\((\d+)\)", constants.get(operand, ""))
            if m:
                return int(m.group(1))
        return None

    def multipliers(self) -> dict[str, int]:
        """How often each computation runs per execution of the program: a while
        body x its trip count (when known), everything else x 1 (every branch of a
        conditional as if it ran each time)."""
        return self._runs(None)[0]

    def runs(self, scope_weights: dict[str, float] | None = None):
        """(comp, instr) -> how often the instruction runs per execution of the program.
        Without `scope_weights`, its computation's `multipliers`. With them
        (`Program.scope_weights` of framework/parallel/pipeline/program.py: per named
        scope, the share of its conditional's executions the schedule's table runs its
        work in), a two-way conditional inside named scopes runs its second branch
        (lax.cond's true one, `branch_1_fun`) that share w of the times, its first (the
        idle ranks' pass-through) 1 - w; a conditional directly inside a scope P whose
        branches k the weights name P_k (the sends' switch over patterns) runs branch k
        P_k's share and branch 0 the rest; an instruction in a named scope outside such
        conditionals runs the scope's weight of the times (`scope_weight` of its
        `scoped_name`, each scope counted once on its path)."""
        mult, applied = self._runs(scope_weights)

        def runs(comp: str, instr: Instruction) -> float:
            if not scope_weights or not mult.get(comp):
                return mult.get(comp, 0)
            return mult[comp] * scope_weight(self.scoped_name(comp, instr), scope_weights,
                                             applied[comp])
        return runs

    def _runs(self, scope_weights):
        """({computation: runs per execution}, {computation: the scopes its runs were
        weighted by through its conditionals}); `runs`."""
        mult, applied = defaultdict(int), {}

        def visit(name, factor, scopes):
            mult[name] += factor
            applied[name] = applied[name] & scopes if name in applied else scopes
            for instr in self.computations.get(name, ()):
                for attr, callee in instr.callees:
                    trip = (self.trip_count(instr) or 1) if attr == "body" else 1
                    visit(callee, factor * trip, scopes)
                for branch, (share, inner) in zip(instr.branches, self._branch_shares(
                        name, instr, scope_weights, scopes)):
                    visit(branch, factor * share, inner)

        visit(self.entry, 1, frozenset())
        return mult, applied

    def _branch_shares(self, comp: str, instr: Instruction, scope_weights, scopes):
        """[(share of the runs, the scopes applied inside)] of a conditional's branches:
        one directly inside a scope P whose branches the weights name P_k (a send
        switch, `_indexed_shares`); a two-way one directly inside weighted scopes not
        yet applied on its path (the tick executor's cells, framework/parallel/pipeline/
        lowering.py): 1 - w, w; else every branch every time."""
        n = len(instr.branches)
        if not scope_weights or n < 2:
            return [(1, scopes)] * n
        name = self.scoped_name(comp, instr)
        by_index = _indexed_shares(name, n, scope_weights)
        if by_index is not None:  # (its branches may be another's too: the compiler
            # keeps identical ones once, so their op_names are not read inside them)
            return [(share, scopes | frozenset(scope_weights)) for share in by_index]
        if n != 2:
            return [(1, scopes)] * n
        own = frozenset(_enclosing(name, scope_weights)) - scopes
        if not own:
            return [(1, scopes)] * n
        w = 1.0
        for part in own:
            w *= scope_weights[part]
        return [(1.0 - w, scopes | own), (w, scopes | own)]


_SCOPE_SPLIT = re.compile(r"[/()]")  # an op_name's parts: the named scopes among them


def _indexed_shares(op_name: str, n: int, scope_weights: dict[str, float]):
    """The shares of an n-way conditional directly inside a scope P whose branches
    k >= 1 the weights name `P_k` (a channel's switch over its send patterns,
    framework/parallel/pipeline/comm.py): [1 - their sum, w_1, ..., w_n-1]; None
    where there are no such weights."""
    parts = _scopes(op_name)
    keys = [f"{parts[-2]}_{k}" for k in range(1, n)] if len(parts) > 1 else []
    if not any(key in scope_weights for key in keys):
        return None
    shares = [scope_weights.get(key, 0.0) for key in keys]
    return [max(0.0, 1.0 - sum(shares)), *shares]


def _scopes(op_name: str) -> list[str]:
    """An op_name's path, each part by its own name: autodiff wraps a scope entered
    under it (`jvp(cell_forward)`, `transpose(jvp(cell_forward))`), which names the
    same scope as `cell_forward` (as `scope_weight` reads it)."""
    return [next((name for name in reversed(_SCOPE_SPLIT.split(part)) if name), part)
            for part in op_name.split("/")]


def _enclosing(op_name: str, scope_weights: dict[str, float]) -> list[str]:
    """The weighted scopes that directly enclose a conditional (`.../cell_forward/
    on_last_stage/cond`: the tick executor's, `lowering.cond_fields`), not those a plain
    conditional further inside them sits in (a padded layer's skip in the layer scan:
    its branches are not the table's)."""
    parts = _scopes(op_name)[:-1]  # (the last: the conditional's own primitive)
    found = []
    while parts and parts[-1] in scope_weights:
        found.append(parts.pop())
    return found


def scope_weight(op_name: str, scope_weights: dict[str, float] | None,
                 applied=frozenset()) -> float:
    """The share of its computation's runs an instruction made in the named scopes of
    `op_name` runs (`Program.scope_weights` of framework/parallel/pipeline/program.py:
    how often the schedule's table runs a conditional's branch), 1 outside them, but
    the scopes `applied` already (by the conditional whose branch it is in,
    `Program.runs`). A scope named twice (the split backward's W traced inside its own
    scope again) counts once."""
    weight = 1.0
    for part in dict.fromkeys(_SCOPE_SPLIT.split(op_name)) if scope_weights else ():
        if part not in applied:
            weight *= scope_weights.get(part, 1.0)
    return weight


def operands(instr: Instruction) -> list[str]:
    """The names of an instruction's operands, in order."""
    args = instr.line.split(f" {instr.opcode}(", 1)[-1]
    return re.findall(r"%([\w.\-]+)", args.split(")", 1)[0])


def executed(program: Program, skip=frozenset(), scope_weights=None):
    """(runs per step, its computation's result types by name, instruction) of every
    instruction of a computation the program runs (`Program.multipliers`), but those of
    the computations named in `skip`. `scope_weights`: each branch of a pipeline's
    conditionals as often as the schedule runs it (`Program.runs`); without them every
    branch of a conditional runs each time."""
    mult, runs = program.multipliers(), program.runs(scope_weights)
    for comp, instrs in program.computations.items():
        if mult.get(comp) and comp not in skip:
            types = {i.name: i.result for i in instrs}
            for instr in instrs:
                yield runs(comp, instr), types, instr


# Instructions that run no kernel of their own (control flow, views, the second half of
# an async pair: its start is counted).
NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
             "conditional", "call", "after-all", "partition-id", "replica-id",
             "opt-barrier", "add-dependency"}


def kernels(program: Program, scope_weights=None):
    """`executed`'s (runs per step, result types, instruction) of every instruction
    that launches a kernel: a fusion (its fused computation is part of it) or an unfused
    instruction that runs one, not those in `NO_KERNEL`, an async pair's `-done`, or the
    reducers a reduce or all-reduce applies (`to_apply`: part of the kernel)."""
    reducers = {c for instrs in program.computations.values() for i in instrs
                for attr, c in i.callees if attr == "to_apply"}
    for factor, types, instr in executed(program, fused(program) | reducers, scope_weights):
        if instr.opcode not in NO_KERNEL and not instr.opcode.endswith("-done"):
            yield factor, types, instr


def outputs(instrs: dict) -> list[str]:
    """The names of a computation's outputs ({name: Instruction}): its root, or a tuple
    root's operands."""
    root = next(i for i in instrs.values() if i.line.lstrip().startswith("ROOT "))
    return operands(root) if root.opcode == "tuple" else [root.name]


def fused(program: Program) -> set[str]:
    """The computations fusions call (each one kernel of the compiled program)."""
    return {callee for instrs in program.computations.values() for instr in instrs
            if instr.opcode == "fusion" for attr, callee in instr.callees if attr == "calls"}


def parse(hlo: str) -> Program:
    comps = split_computations(hlo)
    entry = comps.pop("__entry__", [""])[0]
    module = _MODULE.search(hlo)
    return Program(module.group(1) if module else "", entry,
                   {name: [i for i in map(parse_instruction, lines) if i is not None]
                    for name, lines in comps.items()})
