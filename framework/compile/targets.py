"""Compile targets: the cluster a program is compiled for, named as a user names it.

    local          the devices this process would run on (`devices.platform`)
    tpu:v5p-256    a TPU slice by version and size, in Google Cloud's names: v5p counts
                   TensorCores (2 per chip, one JAX device per chip: 128 devices);
                   v5e and v6e count chips
    gpu:h100x64    NVIDIA GPUs by model and count: up to 8 on one host, beyond that
                   hosts of 8 (h100x64 = 8 hosts x 8)

A TPU slice's chips form a torus whose shape `get_topology_desc` takes by name
("v5p:4x4x8"); a GPU cluster is described to XLA by a data file of `gpus/` (the device's
published figures, as a GpuTargetConfigProto) and a shape "slices x hosts x GPUs per
host". Both give compile-only devices: XLA compiles for them on a machine with no
accelerator (the CUDA plugin and libtpu of the `aot` extra). Adding a target kind
touches this file only; adding a GPU model adds one file to `gpus/`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from framework.errors import ConfigError
from framework.hardware import GPUS_PER_HOST, accelerator
from framework.runtime.quiet import filtered_stderr

GPU_DIR = Path(__file__).resolve().parent / "gpus"

# Torus shapes by chip count. v5p: 3-D; v5e/v6e: 2-D, at most 256 chips per slice.
_TORUS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
             256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16"}
_TORUS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
             256: "16x16"}


@dataclass(frozen=True)
class TpuVersion:
    names_per_chip: int  # how many units the slice name counts per chip (v5p: cores)
    torus: dict  # chips -> torus shape

    def hbm_bytes(self, version: str) -> int:
        """Per chip, usable by XLA: the device catalogue's (framework/hardware.py)."""
        return int(accelerator(f"tpu {version}").memory_bytes)


TPUS = {"v5p": TpuVersion(2, _TORUS_3D), "v5e": TpuVersion(1, _TORUS_2D),
        "v6e": TpuVersion(1, _TORUS_2D)}


@dataclass(frozen=True)
class Target:
    name: str  # as given, e.g. "gpu:h100x64"
    platform: str  # "gpu", "tpu" or "local"
    n_devices: int  # 0 for local (whatever the run would get)
    topology: str  # "v5p:4x4x8" (TPU), "1x8x8" (GPU), "" (local)
    device_bytes: int | None  # memory of one device (None: local, known only there)
    config_text: str = ""  # GPU: the GpuTargetConfigProto text

    @property
    def device_name(self) -> str:
        """The device as the peak-FLOP table names it (`framework/analysis/flops.py`):
        "tpu v5p", "h100"; "" for local."""
        if self.platform == "tpu":
            return "tpu " + self.topology.split(":")[0]
        return self.name.partition(":")[2].partition("x")[0] if self.platform == "gpu" else ""


def gpu_models() -> list[str]:
    return sorted(p.stem for p in GPU_DIR.glob("*.txtpb"))


def examples() -> str:
    return ("local, tpu:v5p-<cores> (e.g. tpu:v5p-256), tpu:v5e-<chips>, tpu:v6e-<chips>, "
            f"gpu:<model>x<count> (models {', '.join(gpu_models())}; e.g. gpu:h100x64)")


def parse(name: str) -> Target:
    """The target named by `target=`; a one-line ConfigError for anything else."""
    if name == "local":
        return Target(name, "local", 0, "", None)
    kind, _, rest = name.partition(":")
    if kind == "tpu":
        return _tpu(name, rest)
    if kind == "gpu":
        return _gpu(name, rest)
    raise ConfigError(f"target={name} is not a compile target: use {examples()}")


def _tpu(name: str, rest: str) -> Target:
    m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", rest)
    version = TPUS.get(m.group(1)) if m else None
    if version is None:
        raise ConfigError(f"target={name}: TPU versions are {', '.join(TPUS)}, named like "
                          f"tpu:v5p-256 or tpu:v6e-64")
    count = int(m.group(2))
    chips = count // version.names_per_chip
    if count % version.names_per_chip or chips not in version.torus:
        sizes = ", ".join(str(c * version.names_per_chip) for c in version.torus)
        raise ConfigError(f"target={name}: a {m.group(1)} slice has one of these sizes: {sizes}")
    return Target(name, "tpu", chips, f"{m.group(1)}:{version.torus[chips]}",
                  version.hbm_bytes(m.group(1)))


def _gpu(name: str, rest: str) -> Target:
    m = re.fullmatch(r"([a-z0-9]+)x(\d+)", rest)
    if not m or m.group(1) not in gpu_models():
        raise ConfigError(f"target={name}: GPU targets are <model>x<count> with a model "
                          f"of {', '.join(gpu_models())}, e.g. gpu:h100x8")
    count = int(m.group(2))
    if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
        raise ConfigError(f"target={name}: up to {GPUS_PER_HOST} GPUs on one host, beyond that "
                          f"a multiple of {GPUS_PER_HOST} (hosts of {GPUS_PER_HOST})")
    hosts, per_host = (1, count) if count <= GPUS_PER_HOST else (count // GPUS_PER_HOST,
                                                                  GPUS_PER_HOST)
    text = (GPU_DIR / f"{m.group(1)}.txtpb").read_text()
    memory = int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))
    return Target(name, "gpu", count, f"1x{hosts}x{per_host}", memory, text)


AOT_EXTRA = "pip install -e '.[aot]'"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _require(modules: tuple[str, ...], what: str) -> None:
    if not any(_installed(m) for m in modules):
        import jax

        raise ConfigError(f"compiling for {what} needs the ahead-of-time extra: {AOT_EXTRA} "
                          f"(or pip install 'jax[{'tpu' if what == 'TPUs' else 'cuda12'}]"
                          f"=={jax.__version__}')")


def compile_devices(target: Target) -> list:
    """Compile-only devices of a TPU or GPU target (on any machine; no accelerator)."""
    from jax.experimental import topologies

    if target.platform == "tpu":
        _require(("libtpu",), "TPUs")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server here
        # Compiling only: other processes may hold libtpu at the same time (its lock
        # file otherwise refuses every process but the first).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        with filtered_stderr():
            return list(topologies.get_topology_desc(topology_name=target.topology,
                                                     platform="tpu").devices)
    _require(("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"), "NVIDIA GPUs")
    with filtered_stderr():
        return list(topologies.get_topology_desc(
            platform="cuda", target_config=target.config_text, topology=target.topology).devices)


def _version(text: str, field: str) -> tuple[int, int]:
    """(major, minor) of a `field { major: M minor: m }` of a GPU target config."""
    found = re.search(field + r"\s*\{\s*major:\s*(\d+)(?:\s*minor:\s*(\d+))?", text)
    return (int(found.group(1)), int(found.group(2) or 0)) if found else (0, 0)


@contextlib.contextmanager
def cudnn_of(target: Target):
    """While tracing and compiling for `target` on a machine without the cuDNN library:
    JAX's lowering of cuDNN's fused attention asks the library for its version and the
    local GPU for its compute capability, and fails; the target's config names both
    (`dnn_version_info`, `cuda_compute_capability`), so JAX is told those instead, and
    XLA's GPU compiler compiles the fused attention's custom calls without a device
    (jaxlib 0.10.2: `__cudnn$fmhaSoftmax` and its backward in llama_1b_8gpu's step for
    gpu:h100x8, 2026-11-27). A GPU target only, and only where the library is missing:
    on a GPU machine JAX asks its own cuDNN."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    try:
        missing = target.platform == "gpu" and not fused.check_cudnn_version()
    except (RuntimeError, OSError):
        missing = target.platform == "gpu"
    if not missing:
        yield
        return
    major, minor = _version(target.config_text, "dnn_version_info")
    capability = _version(target.config_text, "cuda_compute_capability")
    saved = fused.check_cudnn_version, fused.check_compute_capability
    fused.check_cudnn_version = lambda: major * 10000 + minor * 100
    fused.check_compute_capability = lambda wanted: capability >= tuple(
        int(x) for x in wanted.split("."))
    try:
        yield
    finally:
        fused.check_cudnn_version, fused.check_compute_capability = saved
