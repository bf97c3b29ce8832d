"""Which devices a run uses, decided before JAX starts its backend.

`devices.platform`:
    auto  the accelerators JAX finds (GPU or TPU), else simulated CPU devices
    cpu   simulated CPU devices, even when accelerators are present
    gpu   / tpu: that platform, or a one-line error when it is missing

CPU devices are simulated with `jax_num_cpu_devices`, which must be set before the
first JAX call that starts a backend; afterwards the count is fixed for the process
(hence one process per job in multirun, see `framework/sweep.py`). How many:
    devices.local_device_count, if set;
    else pipeline * data * tensor when all three degrees are given;
    else (parallel.data = -1) max(8, pipeline * tensor), and data fills the rest;
in a multi-process run (framework/distributed.py) the two last counts are the whole
mesh's, split evenly among the processes.
On a single CPU the simulated devices share its cores: they show the parallel program
and its overhead, never a speed-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from framework import distributed
from framework.config import ConfigError, DevicesConfig, DistributedConfig, ParallelConfig

PLATFORMS = ("auto", "cpu", "gpu", "tpu")
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
    fixed = max(parallel.pipeline, 1) * max(parallel.tensor, 1)
    total = max(DEFAULT_SIMULATED, fixed) if parallel.data == -1 else fixed * max(parallel.data, 1)
    if n_processes == 1:
        return total
    if n_processes is None or total % n_processes:
        raise ConfigError(f"cannot split {total} simulated CPU devices evenly among "
                          f"{n_processes or 'an unknown number of'} processes: set "
                          f"devices.local_device_count (devices per process)")
    return total // n_processes


COMPILE_CACHE = Path("~/.cache/framework/jax-compile").expanduser()


def enable_compile_cache() -> None:
    """JAX's persistent compilation cache, so a configuration compiled once loads in a
    fraction of a second next time (sweeps, repeated runs, the tests). JAX reads
    JAX_COMPILATION_CACHE_DIR itself; when it is set (even empty, which disables the
    cache) this leaves it alone."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        import jax

        jax.config.update("jax_compilation_cache_dir", str(COMPILE_CACHE))


def _check_platform(platform: str) -> None:
    if platform not in PLATFORMS:
        raise ConfigError(f"devices.platform={platform!r} is not one of {', '.join(PLATFORMS)}")


def start(devices: DevicesConfig, parallel: ParallelConfig,
          multi: DistributedConfig | None = None) -> DeviceSet:
    """Configures JAX for `devices.platform`, joins the other processes of a multi-process
    run (`framework/distributed.py`), starts the backend and returns every process's
    devices. Must be the first thing in the process that starts a JAX backend."""
    _check_platform(devices.platform)
    launch = distributed.plan(multi or DistributedConfig())
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
    if devices.platform != "auto":
        jax.config.update("jax_platforms", devices.platform)
    distributed.initialize(launch)
    try:
        found = tuple(jax.devices())
    except RuntimeError as err:
        raise ConfigError(f"devices.platform={devices.platform} is not available here "
                          f"({_missing_platform(devices.platform, err)}); use "
                          f"devices.platform=auto or cpu") from None
    platform = found[0].platform
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    return DeviceSet(found, platform, platform == "cpu", str(found[0].device_kind),
                     jax.process_index(), jax.process_count())


def _missing_platform(platform: str, err: RuntimeError) -> str:
    """Why JAX has no such device, in words. JAX's own message for a missing GPU names
    the last backend it probed (ROCm), which misleads on a machine without any GPU."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if platform == "gpu" and ("rocm" in first.lower() or "unknown backend" in first.lower()):
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
    if devices.platform == "cpu":
        return simulated_count(devices, parallel)
    found = _probe(devices.platform)
    if found is None:
        return None
    platform, count = found
    return simulated_count(devices, parallel) if platform == "cpu" else count
