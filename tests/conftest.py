"""Test setup: 8 simulated CPU devices, fixed before JAX starts its backend, and one
fresh persistent compilation cache for the session. Many tests compile the same
programs (a layout checked in several files, the command-line runs' subprocesses), and
the cache compiles each once; being fresh, it cannot hide a change from the tests.
XLA's LLVM back end optimises less (--xla_backend_optimization_level=0): the tests'
programs are tiny, so compiling them dominates and running them does not; the HLO
(sharding, collectives, buffer assignment, hence the memory figures) is unchanged."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="framework-test-jax-cache-")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_collection_modifyitems(config, items):
    """Everything under tests/e2e/ is end to end (marker `e2e`; see tests/README.md)."""
    import pytest

    for item in items:
        if "/e2e/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
