"""The one topology object: a device mesh with axes (pipe, data, context, tensor), and
the names of its axes, which every other module imports from here.

Expert parallelism (`parallel.expert=E` > 1) carves an `expert` axis out of the data
devices: the mesh becomes (pipe, data/E, expert=E, context, tensor). `parallel.data`
keeps its meaning, the number of data replicas of the batch: the batch is split over
`data` and `expert` together (`batch_axes`), so `expert` is a batch axis for the dense
layers and the axis the MoE layers' experts are sharded over. With E = 1 there is no
`expert` axis at all, and every program is the one without expert parallelism.

`tensor` is innermost so tensor-parallel groups are neighbouring devices (the fastest
links: NVLink within a node), `context` next (its ring passes keys and values every
layer), `pipe` outermost (point-to-point traffic only, the slowest links are fine).
Axis types are Auto; the engine's shard_map is manual over all of them. With Explicit
axes the compiler all-gathers weights at the shard_map boundary (see the audit).
`context` of size 1 changes nothing: every program of a 3-axis layout is the same.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AxisType

from framework.config import ParallelConfig
from framework.errors import ConfigError
from framework.parallel.pipeline.schedule import uses_virtual_stages

PIPE, DATA, CONTEXT, TENSOR = "pipe", "data", "context", "tensor"
EXPERT = "expert"  # only in meshes with parallel.expert > 1 (`mesh_axes`)
AXES = (PIPE, DATA, CONTEXT, TENSOR)  # mesh order: outermost first (without `expert`)


def expert_degree(parallel: ParallelConfig) -> int:
    return parallel.expert


def mesh_axes(parallel: ParallelConfig) -> tuple[str, ...]:
    """The mesh's axes, outermost first: AXES, with `expert` after `data` when E > 1."""
    return (PIPE, DATA, EXPERT, CONTEXT, TENSOR) if expert_degree(parallel) > 1 else AXES


def degrees(parallel: ParallelConfig) -> dict[str, int]:
    """Each mesh axis's degree, in mesh order: the one place the settings become axes.
    With expert parallelism `data` is the data replicas per expert group, data/E."""
    e = expert_degree(parallel)
    if e > 1:
        return {PIPE: parallel.pipeline, DATA: parallel.data // e, EXPERT: e,
                CONTEXT: parallel.context, TENSOR: parallel.tensor}
    return {PIPE: parallel.pipeline, DATA: parallel.data, CONTEXT: parallel.context,
            TENSOR: parallel.tensor}


def batch_axes(parallel: ParallelConfig):
    """The mesh axes the batch's rows are split over (and the dense parameters'
    gradients summed over): `data`, or (`data`, `expert`) with expert parallelism."""
    return (DATA, EXPERT) if expert_degree(parallel) > 1 else DATA


def resolve_data_degree(parallel: ParallelConfig, n_devices: int) -> ParallelConfig:
    """Returns a copy with `data: -1` replaced by the devices left over."""
    if parallel.data != -1:
        return parallel
    rest = parallel.pipeline * parallel.context * parallel.tensor
    if rest < 1 or n_devices % rest:
        raise ConfigError(
            f"parallel.data=-1 cannot fill {n_devices} devices with "
            f"parallel.pipeline*context*tensor={rest}: pick pipeline, context and tensor "
            f"whose product divides {n_devices}"
        )
    return dataclasses.replace(parallel, data=n_devices // rest)


def mesh_name(parallel: ParallelConfig) -> str:
    """The layout in a few characters, e.g. pp2-dp2-tp2-mb4-1f1b (run and folder names)."""
    p = parallel
    cp = f"-cp{p.context}" if p.context > 1 else ""
    name = f"pp{p.pipeline}-dp{p.data}{cp}-tp{p.tensor}-mb{p.microbatches}"
    if expert_degree(p) > 1:
        name += f"-ep{p.expert}"
    if p.schedule != "gpipe":
        name += f"-{p.schedule}"
        if uses_virtual_stages(p.schedule):
            name += f"-v{p.virtual_stages}"
    return name


def make_mesh(parallel: ParallelConfig, devices=None) -> jax.sharding.Mesh:
    """Mesh over the first pipeline*data*context*tensor devices (all by default)."""
    n = parallel.n_devices
    devices = list(jax.devices() if devices is None else devices)[:n]
    if len(devices) < n:
        raise ValueError(f"the mesh needs {n} devices but only {len(devices)} are available")
    shape, axes = tuple(degrees(parallel).values()), mesh_axes(parallel)
    types = (AxisType.Auto,) * len(axes)
    try:
        return jax.make_mesh(shape, axes, axis_types=types, devices=devices)
    except NotImplementedError:  # a TPU torus none of whose axes products give a degree
        from jax.experimental import mesh_utils  # (e.g. 8 on 4x4x4): split its axes

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return jax.sharding.Mesh(grid, axes, axis_types=types)


def describe(mesh: jax.sharding.Mesh, simulated: bool = False) -> str:
    kind = mesh.devices.flat[0].platform
    shape = " ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names
                     if a != CONTEXT or mesh.shape[a] > 1)
    sim = " (simulated)" if simulated else ""
    return f"mesh {shape} on {mesh.devices.size} {kind} devices{sim}"
