"""The kernels a compiled step launches, per step, by kind, read from the optimized
program: where FP8's casts, absolute maxima and scalar all-reduces show before any GPU
runs them (docs/performance.md, "FP8's extra kernels, as the compiler builds them").

Each kernel (`hlo.kernels`: a fusion, or an unfused instruction that launches one; the
reducers a reduce or all-reduce applies are part of it) counts once per run of its
computation (`hlo.Program.multipliers`: a while body x its trip count; both branches
of a conditional as if run every time, unless the pipeline's `scope_weights` say how
often its table runs each: `hlo.Program.runs`, what `framework.compile` reports since
2026-12-02). Kinds, first match:

  gemm        a fusion holding a dot (the GPU compiler's cuBLAS(Lt) and Triton GEMMs) or
              a library GEMM call
  attention   a library attention kernel (cuDNN's fused attention, forward or backward)
  collective  a collective's start (or a synchronous collective); `scalar_all_reduce`
              those of one value (FP8's whole-tensor maxima, `TensorParallel.whole_max`)
  fp8_cast    a fusion that writes an FP8 array from an array of a wider float type
              (a quantization; FP8 values only moved, as a collective matmul's ring
              writes its FP8 blocks into place, are a `fusion`)
  amax        a fusion that reduces absolute values and writes no FP8 (an absolute
              maximum's first pass; a second pass, over the first's partial maxima, is
              a `fusion`)
  fusion      any other fusion (elementwise, reductions, slices and updates)
  other       any other kernel (copies, unfused elementwise ops)
"""

from __future__ import annotations

import re
from collections import Counter

from framework.analysis import hlo
from framework.analysis.gemms import FP8

KINDS = ("gemm", "attention", "collective", "scalar_all_reduce", "fp8_cast", "amax",
         "fusion", "other")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute", "collective-broadcast")
_WRITES_FP8 = re.compile(r"= (?:\()?(?:%s)\[" % "|".join(FP8))
_SCALAR = re.compile(r"^\(?\s*[a-z0-9]+\[\]")
_WIDER = re.compile(r"^(?:bf16|f16|f32|f64)\[\d")  # an array of a wider float type


def kernels_per_step(text: str, scope_weights=None) -> dict[str, float]:
    """{kind: kernels per step} of a compiled program's text (`compiled.as_text()`),
    every kind of `KINDS` present (0 where none); `scope_weights`: a pipeline's
    branches as often as its table runs them (`hlo.Program.runs`)."""
    program = hlo.parse(text)
    out = Counter({k: 0.0 for k in KINDS})
    for factor, _types, instr in hlo.kernels(program, scope_weights):  # (hlo.py)
        for kind in _kinds(program, instr):
            out[kind] += factor
    return dict(out)


def _kinds(program: hlo.Program, instr: hlo.Instruction) -> tuple[str, ...]:
    op = instr.opcode
    if op == "fusion":
        return (_fusion_kind(program, dict(instr.callees)["calls"]),)
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', instr.line)
        target = target.group(1) if target else ""
        return ("attention",) if "fmha" in target else (
            ("gemm",) if "gemm" in target or "matmul" in target or "cublas" in target
            else ("other",))
    base = op[:-len("-start")] if op.endswith("-start") else op
    if base in _COLLECTIVES:
        scalar = base == "all-reduce" and _SCALAR.match(instr.result)
        return ("collective", "scalar_all_reduce") if scalar else ("collective",)
    return ("other",)


def _fusion_kind(program: hlo.Program, comp: str) -> str:
    body = program.computations[comp]
    if any(i.opcode in ("dot", "custom-call") for i in body):
        return "gemm"
    by_name = {i.name: i for i in body}
    writes_fp8 = any(_WRITES_FP8.search(by_name[name].line) for name in hlo.outputs(by_name))
    if writes_fp8 and any(_WIDER.match(i.result) for i in body if i.opcode == "parameter"):
        return "fp8_cast"
    opcodes = {i.opcode for i in body}
    return "amax" if {"reduce", "abs"} <= opcodes else "fusion"
