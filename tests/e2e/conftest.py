"""End-to-end tests: the command lines as a user runs them, in subprocesses. Every test
here is marked `e2e` (left out of the fast tier: `pytest -m "not e2e and not slow"`)."""

import os

import pytest


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    """The subprocesses' environment: one fresh JAX compilation cache for all of them (the
    tests' own, so a stale user cache can neither help nor hurt); runs one after the
    other, so the first run of a program compiles it and the next ones load it."""
    cache = tmp_path_factory.mktemp("jax_compile_cache")
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
