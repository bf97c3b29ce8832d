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


def matmul_flops(text: str, scope_weights: dict[str, float] | None = None
                 ) -> dict[tuple[str, bool], float]:
    """FLOPs per step of the program's dots by (lhs operand dtype, a layer's or not).
    `scope_weights`: how often the pipeline's conditionally run scopes run
    (`hlo.scope_weight`); without them every branch of a conditional counts whole."""
    out = defaultdict(float)
    for factor, types, instr in hlo.executed(hlo.parse(text), scope_weights=scope_weights):
        if instr.opcode != "dot":
            continue
        names = hlo.operands(instr)
        dtype, lhs = _array(types.get(names[0], "")) if names else ("", [])
        contracting = _CONTRACTING.search(instr.line)
        dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
        k = math.prod(lhs[d] for d in dims if d < len(lhs))
        out[dtype, "Block" in instr.op_name] += factor * 2.0 * math.prod(
            _array(instr.result)[1]) * k
    return dict(out)


def fp8_share(text: str) -> float | None:
    """The share of the layers' matmul FLOPs on FP8 operands (None: no layer matmul)."""
    flops = matmul_flops(text)
    layers = sum(f for (_, layer), f in flops.items() if layer)
    fp8 = sum(f for (dtype, layer), f in flops.items() if layer and dtype in FP8)
    return fp8 / layers if layers else None
