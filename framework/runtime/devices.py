"""Which devices a run uses, decided before JAX starts its backend.

`devices.platform`:
    auto  the accelerators JAX finds (GPU or TPU), else simulated CPU devices
    cpu   simulated CPU devices, even when accelerators are present
    gpu   / tpu: that platform, or a one-line error when it is missing

CPU devices are simulated with `jax_num_cpu_devices`, which must be set before the
first JAX call that starts a backend; afterwards the count is fixed for the process
(hence one process per job in multirun, see `framework/run/sweep.py`). How many:
    devices.local_device_count, if set;
    else pipeline * data * context * tensor when all the degrees are given;
    else (parallel.data = -1) max(8, pipeline * context * tensor), and data fills the rest;
in a multi-process run (framework/runtime/distributed.py) the two last counts are the whole
mesh's, split evenly among the processes.
On a single CPU the simulated devices share its cores: they show the parallel program
and its overhead, never a speed-up.

Process settings made here, before the backend starts (`runtime_settings`):
    GPU  XLA's latency-hiding scheduler, which moves the asynchronous collectives (XLA's
         default on GPUs) so that they overlap with independent computation, the
         highest-priority stream for them, and room for it to do so in programs that
         fill the device (its memory limit): GPU_XLA_FLAGS, added to XLA_FLAGS unless the
         user's own XLA_FLAGS already sets that flag (theirs wins). XLA's allocator may
         take 90% of the GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 unless set; the
         client's default is 75%), the share the planner assumes; the rest is left to
         cuDNN/NCCL workspaces.
    CPU  glibc malloc serves every allocation from its main heap and keeps freed memory
         (mallopt: one arena, no mmap, trim threshold 1 GiB). XLA:CPU allocates the
         step's temporaries afresh on every execution; glibc maps any block of 32 MiB
         or more with mmap and unmaps it on free, so every step page-faulted its
         temporaries in again (15.8k faults per step for a 62 MiB temp buffer, most of
         the run's kernel time). Skipped when the user sets MALLOC_* or GLIBC_TUNABLES,
         preloads another allocator, or the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import logging
import os
import platform as platform_lib
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from framework.runtime import distributed
from framework.runtime.quiet import filtered_stderr
from framework.errors import ConfigError
from framework.hardware import USABLE_FRACTION
from framework.config import DevicesConfig, DistributedConfig, ParallelConfig, not_one_of

DEFAULT_SIMULATED = 8  # CPU devices simulated when parallel.data = -1


@dataclass(frozen=True)
class DeviceSet:
    devices: tuple  # the jax.Device objects the run may use, in jax.devices() order
    platform: str  # "cpu", "gpu" or "tpu"
    simulated: bool  # CPU devices simulated by XLA (not real parallel hardware)
    kind: str  # device_kind of the first device, e.g. "NVIDIA H100 80GB HBM3"
    process_index: int = 0  # this process, in a multi-process run
    process_count: int = 1

    def __len__(self) -> int:
        return len(self.devices)


def simulated_count(devices: DevicesConfig, parallel: ParallelConfig,
                    n_processes: int | None = 1) -> int:
    """How many CPU devices to simulate in this process (see the module docstring).
    n_processes: of the run (None: unknown, then devices.local_device_count is needed)."""
    if devices.local_device_count is not None:
        if devices.local_device_count < 1:
            raise ConfigError(f"devices.local_device_count={devices.local_device_count} "
                              f"must be >= 1 (or null to size it from the degrees)")
        return devices.local_device_count
    fixed = max(parallel.pipeline, 1) * max(parallel.context, 1) * max(parallel.tensor, 1)
    total = max(DEFAULT_SIMULATED, fixed) if parallel.data == -1 else fixed * max(parallel.data, 1)
    if n_processes == 1:
        return total
    if n_processes is None or total % n_processes:
        raise ConfigError(f"cannot split {total} simulated CPU devices evenly among "
                          f"{n_processes or 'an unknown number of'} processes: set "
                          f"devices.local_device_count (devices per process)")
    return total // n_processes


# XLA:GPU options of every GPU program: a run passes them as XLA_FLAGS, a program
# compiled for a GPU target (framework.compile) as compiler options.
GPU_XLA_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_highest_priority_async_stream": True,
    # The latency-hiding scheduler's memory limit, in percent of the device's memory
    # (XLA's default 95). Its own estimate of the program's memory runs well above the
    # buffer assignment's: at 95 it hid none of llama3_70b's tensor-parallel bytes on
    # 80 GiB H100s (a 72.3 GiB program), at 130 46%, at 150 80% (the 8B's share),
    # the compiled memory unchanged (docs/compile.md). The compiled memory, not this
    # estimate, is what the run's memory check and framework.compile hold against the
    # device.
    "xla_gpu_memory_limit_slop_factor": 150,
    # How many asynchronous collectives may be in flight at once (XLA's default 1). A
    # pipeline cell holds tensor-parallel collectives, so at 1 no stage-to-stage send
    # could run beside a cell: the scheduler put every overlapped send between two
    # cells, beside elementwise work only (llama_1b_8gpu 1F1B: 0% of the send bytes
    # beside a matmul; at 4, 100%, 0.06 GiB more memory; llama3_70b 100%, +0.1 GiB).
    # With FSDP the layers' gathers take slots too: at 4 llama3_70b's gradient sends went
    # back between the cells (50%); at 8, 100% (+0.35 GiB without FSDP, docs/compile.md).
    # The MoE recipes' exchange in parts (parallel.expert_chunks=4) takes more: at 8
    # Qwen3-30B-A3B's sends fell from 81% to 40% beside a matmul; at 16 they stay at 81%
    # and 94% of its all-to-all bytes overlap (2026-11-29).
    "xla_gpu_experimental_parallel_collective_overlap_limit": 16,
}
GPU_XLA_FLAGS = tuple(f"--{k}={str(v).lower()}" for k, v in GPU_XLA_OPTIONS.items())
# glibc mallopt parameters (malloc.h) and the values set on CPU (see the module docstring).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
CPU_MALLOPT = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30))


def _accelerator_plugins() -> list[str]:
    """Installed JAX accelerator plugins (distribution names), without starting JAX."""
    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    return sorted(n for n in names if n.startswith(("jax-cuda", "jax-rocm", "libtpu")))


def with_gpu_flags(xla_flags: str) -> str:
    """XLA_FLAGS plus GPU_XLA_FLAGS, except flags the given string already sets."""
    have = {tok.split("=", 1)[0] for tok in xla_flags.split()}
    added = [f for f in GPU_XLA_FLAGS if f.split("=", 1)[0] not in have]
    return " ".join([xla_flags.strip()] + added).strip()


def tune_cpu_allocator() -> bool:
    """The CPU allocator settings of the module docstring; True when applied."""
    user_set = any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in os.environ)
    preloaded = os.environ.get("LD_PRELOAD", "")
    if user_set or preloaded or platform_lib.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in CPU_MALLOPT)


GPU_MEMORY_FRACTION = str(USABLE_FRACTION)  # the device catalogue's (framework/hardware.py)


def runtime_settings(platform: str) -> None:
    """Settings that must precede the backend (module docstring). `platform`:
    devices.platform; with `auto`, the installed plugins say which applies."""
    plugins = _accelerator_plugins() if platform == "auto" else []
    if platform == "gpu" or any(p.startswith(("jax-cuda", "jax-rocm")) for p in plugins):
        os.environ["XLA_FLAGS"] = with_gpu_flags(os.environ.get("XLA_FLAGS", ""))
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
    if platform == "cpu" or (platform == "auto" and not plugins):
        tune_cpu_allocator()


COMPILE_CACHE = Path("~/.cache/framework/jax-compile").expanduser()


def compile_cache_safe(devset: "DeviceSet") -> bool:
    """Whether programs may be loaded from JAX's persistent compilation cache here.

    Not with several CPU devices: XLA:CPU (jaxlib 0.10.2) runs a program with
    collectives that it loaded from the cache with its collectives no longer ordered
    among themselves, and all of them share one rendezvous key (channel_id 1), so two
    that overlap mix their data. Measured with the same 1F1B run loaded from the cache 10
    times: 6 gave wrong gradients (grad norm 56.6 instead of 0.84) or aborted in
    `rendezvous.h` ("Id can't be larger than the number of participating threads");
    compiled afresh, 0 of 20. A program compiled in this process is unaffected."""
    return not (devset.platform == "cpu" and len(devset) > 1)


def enable_compile_cache(devset: "DeviceSet") -> None:
    """JAX's persistent compilation cache, so a configuration compiled once loads in a
    fraction of a second next time (sweeps, repeated runs), where it is safe
    (`compile_cache_safe`; elsewhere it is turned off, also when the user set it). JAX
    reads JAX_COMPILATION_CACHE_DIR itself; when it is set (even empty, which disables
    the cache) this leaves the folder alone."""
    import jax

    if not compile_cache_safe(devset):
        jax.config.update("jax_enable_compilation_cache", False)
    elif "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        jax.config.update("jax_compilation_cache_dir", str(COMPILE_CACHE))


def _check_platform(platform: str) -> None:
    problem = not_one_of("devices.platform", platform)
    if problem:
        raise ConfigError(problem)


def accelerator_hardware() -> bool:
    """Whether this machine shows a GPU or TPU device file (NVIDIA, AMD, TPU VM). Checked
    so that `auto` on a machine without one never starts the installed plugins, which
    would print their failures and, for libtpu, wait on a metadata server."""
    dev = Path("/dev")
    patterns = ("nvidia[0-9]*", "kfd", "accel[0-9]*", "vfio/[0-9]*")
    return any(next(dev.glob(pattern), None) is not None for pattern in patterns)


def jax_platform(platform: str) -> str:
    """JAX's name for devices.platform. `gpu` is the installed GPU plugin's own name:
    JAX >= 0.11 reads jax_platforms=gpu as every GPU backend and fails for the one whose
    plugin is missing (ROCm on an NVIDIA machine, seen with jax 0.11.2)."""
    if platform != "gpu":
        return platform
    plugins = _accelerator_plugins()
    if any(p.startswith("jax-cuda") for p in plugins):
        return "cuda"
    return "rocm" if any(p.startswith("jax-rocm") for p in plugins) else platform


def resolve_platform(platform: str) -> str:
    """devices.platform, with `auto` made `cpu` where no accelerator is present."""
    return "cpu" if platform == "auto" and not accelerator_hardware() else platform


def start(devices: DevicesConfig, parallel: ParallelConfig,
          multi: DistributedConfig | None = None) -> DeviceSet:
    """Configures JAX for `devices.platform`, joins the other processes of a multi-process
    run (`framework/runtime/distributed.py`), starts the backend and returns every process's
    devices. Must be the first thing in the process that starts a JAX backend."""
    _check_platform(devices.platform)
    launch = distributed.plan(multi or DistributedConfig())
    platform = resolve_platform(devices.platform)
    runtime_settings(platform)
    import jax

    try:  # only the CPU backend reads this (harmless on GPU/TPU); raises once started
        try:
            count = simulated_count(devices, parallel, distributed.expected_processes(launch))
        except ConfigError:
            if devices.platform == "cpu":
                raise
            count = 1  # on GPUs/TPUs it does not matter; on CPU validation will say why
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as err:
        raise RuntimeError("devices.start() must run before anything starts a JAX "
                           "backend (the device count is fixed per process)") from err
    if platform != "auto":
        jax.config.update("jax_platforms", jax_platform(platform))
    distributed.initialize(launch)
    bridge = logging.getLogger("jax._src.xla_bridge")  # a plugin's failed start-up, as a
    level, bridge.level = bridge.level, logging.CRITICAL  # traceback: said in one line below
    try:
        with filtered_stderr():
            found = tuple(jax.devices())
    except (RuntimeError, AssertionError) as err:  # AssertionError: JAX 0.10 when every
        # backend of jax_platforms failed to start (a CUDA plugin without a GPU)
        raise ConfigError(f"devices.platform={devices.platform} is not available here "
                          f"({_missing_platform(devices.platform, err)}); use "
                          f"devices.platform=auto or cpu") from None
    finally:
        bridge.setLevel(level)
    platform = found[0].platform
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    return DeviceSet(found, platform, platform == "cpu", str(found[0].device_kind),
                     jax.process_index(), jax.process_count())


def _missing_platform(platform: str, err: Exception) -> str:
    """Why JAX has no such device, in words. JAX's own message for a missing GPU names
    the last backend it probed (ROCm), which misleads on a machine without any GPU; with
    the CUDA plugin installed and no GPU, JAX 0.10 raises a bare AssertionError."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if platform == "gpu" and ("rocm" in first.lower() or "unknown backend" in first.lower()
                              or isinstance(err, AssertionError)):
        return ("JAX finds no GPU: no NVIDIA GPU is visible, or JAX's CUDA plugin is not "
                "installed (pip install 'jax[cuda12]')")
    if platform == "tpu" and "unknown backend" in first.lower():
        return "JAX finds no TPU"
    return first


# A tiny program run in a child process, so the parent never starts a backend (and on
# GPUs never takes their memory): which platform would this run get, with how many devices?
_PROBE = """
import json, sys, jax
if sys.argv[1] != "auto":
    jax.config.update("jax_platforms", sys.argv[1])
d = jax.devices()
print(json.dumps({"platform": d[0].platform, "count": len(d)}))
"""


@lru_cache(maxsize=None)
def _probe(platform: str) -> tuple[str, int] | None:
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, platform], capture_output=True,
                             text=True, timeout=300, check=True).stdout
        found = json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None
    return found["platform"], found["count"]


def planned_count(devices: DevicesConfig, parallel: ParallelConfig) -> int | None:
    """The device count a run with these settings will see, without starting a backend
    in this process (None when it cannot be known). Used to name sweep jobs."""
    if parallel.data != -1:
        return parallel.n_devices
    if resolve_platform(devices.platform) == "cpu":
        return simulated_count(devices, parallel)
    found = _probe(devices.platform)
    if found is None:
        return None
    platform, count = found
    return simulated_count(devices, parallel) if platform == "cpu" else count
