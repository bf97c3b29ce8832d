"""The memory check before allocation (framework/analysis/memory_check.py), and the process
settings made before JAX starts (framework/runtime/devices.py: XLA's GPU overlap flags, the CPU
allocator)."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework import errors
from framework.runtime import devices
from framework.analysis import memory_check, memory_model
from framework.errors import ConfigError
from framework.config import RunConfig
from framework.runtime.devices import DeviceSet

REPO = Path(__file__).resolve().parent.parent
CPU = DeviceSet(devices=(object(),) * 8, platform="cpu", simulated=True, kind="cpu")
ONE_CPU = dataclasses.replace(CPU, devices=(object(),))


def _run_config(limit_gb=None, **model_kw) -> RunConfig:
    from tools.recipe import compose

    cfg = compose(["recipe=llama_tiny_debug"])
    cfg.devices = dataclasses.replace(cfg.devices, memory_limit_gb=limit_gb)
    cfg.model = dataclasses.replace(cfg.model, **model_kw)
    return cfg


def _apply(cfg: RunConfig, overrides: str):
    """'parallel.remat=full model.attention=blockwise ...' applied to cfg's dataclasses."""
    parts = {"model": cfg.model, "parallel": cfg.parallel, "train": cfg.train}
    for item in overrides.split():
        key, value = item.split("=")
        group, name = key.split(".")
        old = getattr(parts[group], name)
        value = (value == "true") if isinstance(old, bool) else type(old)(value)
        parts[group] = dataclasses.replace(parts[group], **{name: value})
    return parts["model"], parts["parallel"], parts["train"]


def test_over_the_limit_names_changes_that_fit():
    cfg = _run_config()
    need = memory_model.predict_memory(cfg.model, cfg.parallel, cfg.train, "cpu")["total"]
    limit = 0.8 * need
    cfg.devices = dataclasses.replace(cfg.devices, memory_limit_gb=limit / 2**30)
    with pytest.raises(errors.MemoryCheckError) as err:
        memory_check.check(cfg, cfg.parallel, CPU)
    line = str(err.value)
    assert "\n" not in line and "over the limit" in line and "devices.memory_check=false" in line
    shown = line.split("predicted to fit: ")[1].split("; devices.memory_check")[0].split("; ")
    assert 1 <= len(shown) <= memory_check.SHOWN
    for suggestion in shown:  # each one, applied, is predicted under the limit
        model, par, train = _apply(cfg, suggestion.rsplit(" (", 1)[0])
        assert memory_model.predict_memory(model, par, train, "cpu")["total"] <= limit
    # With the limit at the prediction the run is not refused; without a check, never.
    cfg.devices = dataclasses.replace(cfg.devices, memory_limit_gb=need / 2**30)
    assert memory_check.check(cfg, cfg.parallel, CPU)["predicted_bytes"] == need
    cfg.devices = dataclasses.replace(cfg.devices, memory_limit_gb=1e-6, memory_check=False)
    assert memory_check.check(cfg, cfg.parallel, CPU) is None


def test_a_model_no_layout_fits_says_so():
    """The issue's example of a new user's mistake, against this host's real limit."""
    cfg = _run_config(d_model=16384, n_layers=64, d_ff=65536, n_heads=128, n_kv_heads=8)
    one = dataclasses.replace(cfg.parallel, pipeline=1, data=1, tensor=1, microbatches=1)
    expected = r"available host memory\); nothing on 1 device is predicted to fit"
    with pytest.raises(errors.MemoryCheckError, match=expected):
        memory_check.check(cfg, one, ONE_CPU)
    limit, source = memory_check.device_limit(CPU)
    assert 0 < limit < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fits = memory_check.check(_run_config(), _run_config().parallel, CPU)  # the tiny model fits
    assert fits["predicted_bytes"] < fits["limit_bytes"] == pytest.approx(limit, rel=0.2)


def test_gpu_flags_and_the_users_own_win(monkeypatch):
    assert devices.with_gpu_flags("") == " ".join(devices.GPU_XLA_FLAGS)
    mine = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
    flags = devices.with_gpu_flags(mine)
    assert flags.startswith(mine) and flags.count("latency_hiding_scheduler") == 1
    assert "--xla_gpu_enable_highest_priority_async_stream=true" in flags
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    devices.runtime_settings("gpu")
    assert os.environ["XLA_FLAGS"].split()[1:] == list(devices.GPU_XLA_FLAGS)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"  # the user's own
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    devices.runtime_settings("gpu")
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == devices.GPU_MEMORY_FRACTION


def test_gpu_is_the_installed_plugins_own_backend(monkeypatch):
    """jax >= 0.11 reads jax_platforms=gpu as CUDA and ROCm both and fails on an NVIDIA
    machine without the ROCm plugin (seen on an H200 with jax 0.11.2)."""
    for plugins, want in ((["jax-cuda13-plugin", "jax-cuda13-pjrt"], "cuda"),
                          (["jax-rocm7-plugin"], "rocm"), ([], "gpu")):
        monkeypatch.setattr(devices, "_accelerator_plugins", lambda p=plugins: p)
        assert devices.jax_platform("gpu") == want
        assert devices.jax_platform("tpu") == "tpu"


def test_the_gpu_dispatch_follows_the_jaxlib(monkeypatch):
    """Pass-through on GPUs from jaxlib 0.11.2 (its compiler keeps it in place), the cells'
    writes apart before; CPU and TPU always pass through."""
    import jaxlib

    from framework.engine import step

    for version, want in (("0.10.2", False), ("0.11.1", False), ("0.11.2", True),
                          ("0.12.0.1", True)):
        monkeypatch.setattr(jaxlib, "__version__", version)
        assert step.passes_through("gpu") is want
        assert step.passes_through("tpu") and step.passes_through("cpu")


def test_flags_are_known_to_this_xla():
    """XLA aborts on an unknown flag: every flag set on GPUs must parse (the flag table is
    shared by all of XLA's back ends, so the CPU client checks it)."""
    env = {**os.environ, "XLA_FLAGS": " ".join(devices.GPU_XLA_FLAGS), "JAX_PLATFORMS": "cpu"}
    code = "import jax; jax.numpy.ones(2).block_until_ready()"
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0


def test_cpu_allocator_setting_respects_the_user(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert devices.tune_cpu_allocator() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    import platform

    assert devices.tune_cpu_allocator() is (platform.libc_ver()[0] == "glibc")


def test_a_nonpositive_limit_is_refused():
    cfg = _run_config(limit_gb=0.0)
    with pytest.raises(ConfigError, match="devices.memory_limit_gb=0.0 must be > 0"):
        memory_check.check(cfg, cfg.parallel, CPU)


class _FakeGPU:
    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_one_gpu_recipe_is_the_largest_batch_that_fits_80gb():
    """recipes/llama_1b_1gpu.yaml: valid on one device, predicted to fit 90% of 80 GiB
    (XLA's share, devices.GPU_MEMORY_FRACTION) with its batch and not with two rows more
    (the GPU compiler's figures, gpu:h100x1, 2026-11-30: 14 rows 65.06 GiB against the
    model's 70.01, 10 rows 52.50 against 55.82); the memory check on such a GPU lets it
    through."""
    from framework.engine.validate import validate
    from tools.recipe import compose

    cfg = compose(["recipe=llama_1b_1gpu"])
    par = validate(cfg.model, cfg.parallel, cfg.train, 1)
    usable = float(devices.GPU_MEMORY_FRACTION) * 80 * 2**30
    need = memory_model.predict_memory(cfg.model, par, cfg.train, "gpu")["total"]
    more = dataclasses.replace(cfg.train, global_batch_size=cfg.train.global_batch_size + 2)
    assert need <= usable < memory_model.predict_memory(cfg.model, par, more, "gpu")["total"]
    gpu = DeviceSet(devices=(_FakeGPU(usable),), platform="gpu", simulated=False,
                    kind="NVIDIA H100 80GB HBM3")
    # On a GPU the compiled program decides (check_compiled, tests/compiled/test_aot.py).
    assert memory_check.check(cfg, par, gpu) is None
