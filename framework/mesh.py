"""The one topology object: a 3D device mesh with axes (pipe, data, tensor).

`tensor` is innermost so tensor-parallel groups are neighbouring devices (the fastest
links: NVLink within a node), `pipe` outermost (point-to-point traffic only, the
slowest links are fine). Axis types are Auto: `data` and `pipe` become manual inside
the engine's shard_map, `tensor` is partitioned by the compiler (GSPMD). With Explicit
axes the compiler all-gathers weights at the shard_map boundary (see the audit).
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType

from framework.config import ParallelConfig

AXES = ("pipe", "data", "tensor")


def make_mesh(parallel: ParallelConfig, devices=None) -> jax.sharding.Mesh:
    """Mesh over the first pipeline*data*tensor devices (all of them by default)."""
    n = parallel.n_devices
    devices = list(jax.devices() if devices is None else devices)[:n]
    if len(devices) < n:
        raise ValueError(f"the mesh needs {n} devices but only {len(devices)} are available")
    return jax.make_mesh((parallel.pipeline, parallel.data, parallel.tensor), AXES,
                         axis_types=(AxisType.Auto,) * 3, devices=devices)


def describe(mesh: jax.sharding.Mesh, simulated: bool = False) -> str:
    kind = mesh.devices.flat[0].platform
    shape = " ".join(f"{a}={mesh.shape[a]}" for a in AXES)
    sim = " (simulated)" if simulated else ""
    return f"mesh {shape} on {mesh.devices.size} {kind} devices{sim}"
