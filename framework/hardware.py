"""The device catalogue: every fact about an accelerator the framework uses, defined
once (peaks per compute dtype, memory, links, devices per node, how much of the memory
XLA may fill, what its compiler does). The MFU of a run, the planner, the memory check,
the compile targets and the executor's dispatch read it here.

Peaks are vendors' dense (no sparsity) figures per chip; float32 compute on NVIDIA GPUs
runs matmuls in TF32 by default in XLA, so it is compared with the TF32 peak. A device
is found by a substring of JAX's lower-cased `device_kind`, the first match winning
(so "h100 pcie" precedes "h100"). Adding an accelerator: one `Accelerator` here (and,
to compile for it without the hardware, a target config in framework/compile/).
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.units import GB, GIB, TB

# Of a device's memory, the share XLA's buffers may fill: the runtime sets the GPU
# allocator's XLA_PYTHON_CLIENT_MEM_FRACTION to it, the planner fits layouts into it.
USABLE_FRACTION = 0.9
GPUS_PER_HOST = 8  # a GPU node (HGX H100/H200/B200, DGX A100)


@dataclass(frozen=True)
class Accelerator:
    key: str  # substring of the lower-cased jax device_kind
    peaks: tuple  # ((compute dtype, dense FLOP/s per chip), ...)
    memory_bytes: float | None = None  # per device, what XLA may address (None: see targets)
    link_bytes: float = 450 * GB  # in-node link per device per direction (NVLink 4)
    network_bytes: float = 50 * GB  # between nodes, per device (one 400 Gb/s NDR link)
    per_node: int = GPUS_PER_HOST
    memory_bandwidth: float | None = None  # HBM bytes/s per device (None: not known)

    def peak(self, dtype: str) -> float | None:
        return dict(self.peaks).get(dtype)


# HBM bandwidth per chip, from the data sheets: H200 4.8 TB/s (HBM3e), H100 SXM 3.35 TB/s
# and H100 PCIe 2.0 TB/s (HBM3/HBM2e), A100 80GB SXM 2,039 GB/s; TPU v5e 819 GB/s, v5p
# 2,765 GB/s, v6e 1,640 GB/s, v4 1,200 GB/s. What the planner prices memory-bound
# per-microbatch work at (framework/analysis/planner.py, `accumulation_seconds`).

# FP8 (E4M3/E5M2) matmuls: the peak of Hopper's FP8 tensor cores. NVIDIA's H100 and
# H200 data sheets give 3,958 TFLOP/s FP8 for the SXM parts and 3,026 for the H100 PCIe
# "with sparsity", half of it dense; A100 and TPU v4-v6e have no FP8 matrix units.
FP8 = "float8"
_BF16, _F32 = "bfloat16", "float32"
CATALOGUE: tuple[Accelerator, ...] = (
    Accelerator("h200", ((_BF16, 989.4e12), (_F32, 494.7e12), (FP8, 1978.9e12)),
                memory_bandwidth=4.8 * TB),
    Accelerator("h100 pcie", ((_BF16, 756.0e12), (_F32, 378.0e12), (FP8, 1513.0e12)),
                memory_bandwidth=2.0 * TB),
    Accelerator("h100", ((_BF16, 989.4e12), (_F32, 494.7e12), (FP8, 1978.9e12)),  # SXM5
                memory_bandwidth=3.35 * TB),
    Accelerator("a100", ((_BF16, 312.0e12), (_F32, 156.0e12)), link_bytes=300 * GB,
                memory_bandwidth=2.039 * TB),
    Accelerator("tpu v5 lite", ((_BF16, 197.0e12),), 16 * GIB, memory_bandwidth=0.819 * TB),
    Accelerator("tpu v5e", ((_BF16, 197.0e12),), 16 * GIB, memory_bandwidth=0.819 * TB),
    # v5p: the HBM its compiler reports ("available HBM (95.74G)")
    Accelerator("tpu v5p", ((_BF16, 459.0e12),), int(95.74 * GIB), memory_bandwidth=2.765 * TB),
    Accelerator("tpu v5", ((_BF16, 459.0e12),), int(95.74 * GIB),  # v5p says "TPU v5"
                memory_bandwidth=2.765 * TB),
    Accelerator("tpu v6e", ((_BF16, 918.0e12),), 32 * GIB, memory_bandwidth=1.64 * TB),  # Trillium
    Accelerator("tpu v4", ((_BF16, 275.0e12),), 32 * GIB, memory_bandwidth=1.2 * TB),
)


DEFAULT = "h100"  # the device the planner assumes when none is named


def accelerator(device_kind: str) -> Accelerator | None:
    """The catalogue's entry for a JAX device kind ("NVIDIA H100 80GB HBM3", "TPU v5"),
    or None (CPU, unknown devices)."""
    kind = device_kind.lower()
    return next((a for a in CATALOGUE if a.key in kind), None)


def memory_bandwidth(device_kind: str) -> float | None:
    """HBM bytes/s of one device, or None if unknown."""
    found = accelerator(device_kind)
    return None if found is None else found.memory_bandwidth


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of one device for `dtype` compute, or None if unknown."""
    found = accelerator(device_kind)
    return None if found is None else found.peak(dtype)


# --- What the compilers do ----------------------------------------------------------------

# The first jaxlib whose GPU compiler keeps a conditional's pass-through in place: 0.11.2
# compiled llama_1b_8gpu's 1F1B step for gpu:h100x8 with no carried buffer copied either
# way, and to 9.96 GiB passing through against 10.79 with the cells' writes apart
# (2026-11-27, docs/performance.md); 0.10.2 copies (the upstream fix, openxla/xla#46314,
# is in 0.11.1, which was not measured).
GPU_PASS_THROUGH_SINCE = (0, 11, 2)


def passes_through(platform: str, jaxlib_version: str) -> bool:
    """Whether the compiler for `platform` keeps a buffer that a conditional passes
    through in place, measured on the compiled tick loop (tests/compiled/
    test_executor.py): XLA's CPU and TPU compilers do; its GPU compiler before jaxlib
    0.11.2 copies it, in the conditional and again after it."""
    if platform not in ("gpu", "cuda"):
        return True
    version = tuple(int(x) for x in jaxlib_version.split(".")[:3] if x.isdigit())
    return version >= GPU_PASS_THROUGH_SINCE


def expands_ragged_dot(platform: str) -> bool:
    """Whether the compiler for `platform` runs `jax.lax.ragged_dot` as one dense dot of
    every row against every group's weights, masked (XLA's GPU compiler, jaxlib 0.10.2:
    a deviceless gpu:h100x8 compile, 2026-11-29), rather than as a grouped matmul (the
    TPU compiler's native ragged-dot kernel): a dropless MoE layer's cost there
    (framework/model/moe.py's `executed_rows`)."""
    return platform in ("gpu", "cuda")


def has_ragged_all_to_all(platform: str) -> bool:
    """Whether the compiler for `platform` has `ragged_all_to_all` (the dropless expert
    exchange, framework/parallel/expert.py): XLA's TPU and GPU compilers (jaxlib 0.10.2,
    deviceless compiles of tpu:v5p-8 and gpu:h100x8 targets); its CPU compiler has not."""
    return platform in ("tpu", "gpu", "cuda")
