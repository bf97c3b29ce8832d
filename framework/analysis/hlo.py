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

_COMP_START = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z\-]+)\((.*)$")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)"
                     r"=\{?%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MODULE = re.compile(r"^HloModule ([\w.\-]+)")


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

    def multipliers(self) -> dict[str, int]:
        """How often each computation runs per execution of the program: a while
        body x its trip count (when known), everything else x 1."""
        mult = defaultdict(int)

        def visit(name, factor):
            mult[name] += factor
            for instr in self.computations.get(name, ()):
                for attr, callee in instr.callees:
                    trip = instr.trip_count if attr == "body" and instr.trip_count else 1
                    visit(callee, factor * trip)
                for branch in instr.branches:
                    visit(branch, factor)

        visit(self.entry, 1)
        return mult


def parse(hlo: str) -> Program:
    comps = split_computations(hlo)
    entry = comps.pop("__entry__", [""])[0]
    module = _MODULE.search(hlo)
    return Program(module.group(1) if module else "", entry,
                   {name: [i for i in map(parse_instruction, lines) if i is not None]
                    for name, lines in comps.items()})
