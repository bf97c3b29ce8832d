"""End-to-end tests: the command lines as a user runs them, in subprocesses. Every test
here is marked `e2e` (left out of the fast tier: `pytest -m "not e2e and not slow"`)."""

import os

import pytest


@pytest.fixture(scope="session")
def env():
    """The subprocesses' environment: without JAX's persistent compilation cache (see
    tests/conftest.py), so that no stale user cache can help or hurt either."""
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": ""}
