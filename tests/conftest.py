"""Test setup: 8 simulated CPU devices, fixed before JAX starts its backend, and no
persistent compilation cache: XLA:CPU runs multi-device programs loaded from it
wrongly (framework/runtime/devices.py, `compile_cache_safe`), and every program of
the tests runs on several simulated devices. XLA's LLVM back end optimises less
(--xla_backend_optimization_level=0): the tests' programs are tiny, so compiling them
dominates and running them does not; the HLO (sharding, collectives, buffer
assignment, hence the memory figures) is unchanged. For the same reason its fusions are
emitted by the older LLVM IR emitters (--xla_cpu_use_fusion_emitters=false): the MLIR
fusion emitters took 2.4 of a pipelined step's 3.4 s of compilation on 2026-11-28 (2.4
-> 1.0 s; same buffers to 64 bytes, same loss to the bit). A device that reaches a
collective more than 40 s after its peers ends the process (XLA:CPU's default
termination timeout, a native abort that loses pytest's report): on a loaded 2-core
machine the 8 simulated devices share the cores, so the tests allow 300 s (CI aborted
once, on 2026-11-29, in the 8-device interleaved FSDP+expert case of
tests/parity/test_dense_prefix.py, which passes alone and in sequence here)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                           " --xla_cpu_use_fusion_emitters=false"
                           " --xla_cpu_collective_call_warn_stuck_timeout_seconds=60"
                           " --xla_cpu_collective_call_terminate_timeout_seconds=300").strip()
os.environ["JAX_COMPILATION_CACHE_DIR"] = ""  # off, also in the subprocesses

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_compilation_cache", False)


def pytest_collection_modifyitems(config, items):
    """Everything under tests/e2e/ is end to end (marker `e2e`; see tests/README.md)."""
    import pytest

    for item in items:
        if "/e2e/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
