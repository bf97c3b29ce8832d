"""Test setup: 8 simulated CPU devices, fixed before JAX starts its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
