"""Which collectives of a scheduled GPU program overlap computation.

XLA's GPU compiler makes collectives asynchronous: a `<kind>-start` launches the
transfer on a communication stream and a `<kind>-done` waits for it (reduce-scatter
and all-to-all appear as `async-start`/`async-done` wrapping a computation that holds
the collective). The program text lists every computation's instructions in schedule
order, so a collective overlaps computation when a matmul is scheduled between its
start and its done: a dot, a library call (cuBLAS, cuDNN), or a fusion, loop or
branch that holds one. Elementwise work alone (a weight's cast to bfloat16, a
transpose, a slice) does not count: it takes a small fraction of a transfer's time
(until 2026-11-26 it counted, and llama3_70b read "84% of tensor bytes overlapped"
where a matmul was beside 4 of its 26 tensor-parallel transfers). A pair with nothing
between them, or one the compiler marked `"is_sync":true` (it runs it on the compute
stream), does not overlap; neither does a plain synchronous collective
(`collective-permute` with no start/done), which is how CPU and TPU programs read here.
Overlapped says that real work runs beside the transfer, not that it covers its time.

`overlapped_names(program)` gives the collective instructions that overlap;
`framework/analysis/audit.py` marks them, and its `overlapped_fraction` weighs them by
bytes per mesh axis.
"""

from __future__ import annotations

import re

MATMUL = frozenset({"dot", "convolution"})
LIBRARY = ("gemm", "cublas", "cudnn")  # custom-call targets that are matmuls or attention
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_OPERAND = re.compile(r"%?([\w.\-]+)")


def _done_of(start: str, instrs: list, index: int) -> int | None:
    for j in range(index + 1, len(instrs)):
        if instrs[j].opcode.endswith("-done"):
            args = instrs[j].line.split(instrs[j].opcode + "(", 1)[-1].split(")", 1)[0]
            if start in _OPERAND.findall(args):
                return j
    return None


def _matmul_in(program, instr, memo: dict) -> bool:
    """Whether `instr` is or holds a matmul (through the computations it calls)."""
    if instr.opcode in MATMUL:
        return True
    if instr.opcode == "custom-call":
        target = _TARGET.search(instr.line)
        return bool(target) and any(k in target.group(1).lower() for k in LIBRARY)
    callees = [c for _, c in instr.callees] + list(instr.branches)
    for callee in callees:
        if callee not in memo:
            memo[callee] = False  # a cycle cannot make a matmul
            memo[callee] = any(_matmul_in(program, x, memo)
                               for x in program.computations.get(callee, ()))
        if memo[callee]:
            return True
    return False


def overlapped_names(program) -> set[str]:
    """Names of the collective instructions that run asynchronously with a matmul
    scheduled between start and done: the `-start` instruction's name, and for
    `async-start` wrappers also the collectives inside the wrapped computation."""
    found, memo = set(), {}
    for instrs in program.computations.values():
        for i, instr in enumerate(instrs):
            if not instr.opcode.endswith("-start") or '"is_sync":true' in instr.line:
                continue
            j = _done_of(instr.name, instrs, i)
            if j is None or not any(_matmul_in(program, x, memo) for x in instrs[i + 1:j]):
                continue
            found.add(instr.name)
            for attr, callee in instr.callees:
                if attr == "calls":
                    found.update(x.name for x in program.computations.get(callee, ()))
    return found
