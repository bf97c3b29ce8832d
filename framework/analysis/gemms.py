"""The matmuls of a compiled program by operand type: how many FLOPs per step run on
FP8 operands (`model.fp8`, framework/model/fp8.py), read from the optimized program.

Every `dot` counts 2 x (result elements) x (contracted elements) FLOPs, times how often
its computation runs per step (`hlo.Program.multipliers`), whether the compiler made it
a cuBLAS(Lt) call or a Triton GEMM fusion (the GPU compiler's GEMM fusions hold the
`dot` with its FP8 operands and their scales); a cuBLAS custom call counts by its
operands' types the same way. Library attention kernels (cuDNN's) are not dots. A
dot is a layer's when its JAX operation came from a `Block` (the op_name), so the
head's matmul (kept in the compute dtype) is told apart.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from framework.analysis import hlo

_ARRAY = re.compile(r"^\(?\s*([a-z0-9]+)\[([0-9,]*)\]")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
FP8 = ("f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz")


def _array(type_text: str) -> tuple[str, list[int]]:
    m = _ARRAY.match(type_text.strip())
    if not m:
        return "", []
    return m.group(1), [int(d) for d in m.group(2).split(",") if d]


def _operand_types(instr: hlo.Instruction, types: dict) -> list[str]:
    args = instr.line.split(f" {instr.opcode}(", 1)[-1].split(")", 1)[0]
    return [types.get(name, "") for name in re.findall(r"%([\w.\-]+)", args)]


def matmul_flops(text: str) -> dict[tuple[str, bool], float]:
    """FLOPs per step of the program's dots by (lhs operand dtype, a layer's or not)."""
    program = hlo.parse(text)
    runs = program.multipliers()
    out = defaultdict(float)
    for comp, instrs in program.computations.items():
        factor = runs.get(comp, 0)
        if not factor:
            continue
        types = {i.name: i.result for i in instrs}
        for instr in instrs:
            if instr.opcode != "dot":
                continue
            operands = _operand_types(instr, types)
            dtype, lhs = _array(operands[0]) if operands else ("", [])
            contracting = _CONTRACTING.search(instr.line)
            dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
            result = math.prod(_array(instr.result)[1])
            k = math.prod(lhs[d] for d in dims if d < len(lhs))
            out[dtype, "Block" in instr.op_name] += factor * 2.0 * result * k
    return dict(out)


def fp8_share(text: str) -> float | None:
    """The share of the layers' matmul FLOPs on FP8 operands (None: no layer matmul)."""
    flops = matmul_flops(text)
    layers = sum(f for (_, layer), f in flops.items() if layer)
    fp8 = sum(f for (dtype, layer), f in flops.items() if layer and dtype in FP8)
    return fp8 / layers if layers else None
