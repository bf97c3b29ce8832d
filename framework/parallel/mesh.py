"""The one topology object: a 3D device mesh with axes (pipe, data, tensor), and the
names of its axes, which every other module imports from here.

`tensor` is innermost so tensor-parallel groups are neighbouring devices (the fastest
links: NVLink within a node), `pipe` outermost (point-to-point traffic only, the
slowest links are fine). Axis types are Auto: `data` and `pipe` become manual inside
the engine's shard_map, `tensor` is partitioned by the compiler (GSPMD). With Explicit
axes the compiler all-gathers weights at the shard_map boundary (see the audit).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AxisType

from framework.config import ParallelConfig
from framework.errors import ConfigError
from framework.parallel.pipeline.schedule import uses_virtual_stages

PIPE, DATA, TENSOR = "pipe", "data", "tensor"
AXES = (PIPE, DATA, TENSOR)  # mesh order: outermost first


def resolve_data_degree(parallel: ParallelConfig, n_devices: int) -> ParallelConfig:
    """Returns a copy with `data: -1` replaced by the devices left over."""
    if parallel.data != -1:
        return parallel
    rest = parallel.pipeline * parallel.tensor
    if rest < 1 or n_devices % rest:
        raise ConfigError(
            f"parallel.data=-1 cannot fill {n_devices} devices with "
            f"parallel.pipeline*parallel.tensor={rest}: pick pipeline and tensor whose "
            f"product divides {n_devices}"
        )
    return dataclasses.replace(parallel, data=n_devices // rest)


def mesh_name(parallel: ParallelConfig) -> str:
    """The layout in a few characters, e.g. pp2-dp2-tp2-mb4-1f1b (run and folder names)."""
    p = parallel
    name = f"pp{p.pipeline}-dp{p.data}-tp{p.tensor}-mb{p.microbatches}"
    if p.schedule != "gpipe":
        name += f"-{p.schedule}"
        if uses_virtual_stages(p.schedule):
            name += f"-v{p.virtual_stages}"
    return name


def make_mesh(parallel: ParallelConfig, devices=None) -> jax.sharding.Mesh:
    """Mesh over the first pipeline*data*tensor devices (all of them by default)."""
    n = parallel.n_devices
    devices = list(jax.devices() if devices is None else devices)[:n]
    if len(devices) < n:
        raise ValueError(f"the mesh needs {n} devices but only {len(devices)} are available")
    shape, types = (parallel.pipeline, parallel.data, parallel.tensor), (AxisType.Auto,) * 3
    try:
        return jax.make_mesh(shape, AXES, axis_types=types, devices=devices)
    except NotImplementedError:  # a TPU torus none of whose axes products give a degree
        from jax.experimental import mesh_utils  # (e.g. 8 on 4x4x4): split its axes

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return jax.sharding.Mesh(grid, AXES, axis_types=types)


def describe(mesh: jax.sharding.Mesh, simulated: bool = False) -> str:
    kind = mesh.devices.flat[0].platform
    shape = " ".join(f"{a}={mesh.shape[a]}" for a in AXES)
    sim = " (simulated)" if simulated else ""
    return f"mesh {shape} on {mesh.devices.size} {kind} devices{sim}"
