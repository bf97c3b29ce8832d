"""The one table that maps the model's logical axes onto the (pipe, data, tensor) mesh.

    stage -> pipe                              (pipeline.layout stacks stages on axis 0)
    heads, kv_heads, mlp, vocab -> tensor      (Megatron column/row-parallel weights)
    everything else (embed, head_dim, norm, layers, chunk, qkv, gate_up) -> replicated

`data` is not in the table: parameters are replicated over `data` (or, with ZeRO-1,
sharded along one free dimension per leaf, chosen in `framework/data_parallel.py`),
and the batch is split over `data` by the engine's shard_map.

This table is the whole tensor-parallel plan: the engine's shard_map specs, the model's
per-device weight shapes and the places of Megatron's collectives
(`framework/tensor_parallel.py`), and the memory and communication models all read it.
A rule the model cannot run (e.g. `embed -> tensor`) raises when the engine is built.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

TENSOR = "tensor"  # the mesh axis of tensor parallelism
TENSOR_SHARDED = ("heads", "kv_heads", "mlp", "vocab")


def param_rules() -> tuple[tuple[str, str | None], ...]:
    return (("stage", "pipe"),) + tuple((name, TENSOR) for name in TENSOR_SHARDED)


def spec(axes: tuple[str, ...], rules) -> P:
    """Logical axis names -> PartitionSpec over mesh axes (unknown names: replicated)."""
    table = dict(rules)
    return P(*(table.get(name) for name in axes))


def param_specs(logical_axes, rules=None):
    rules = param_rules() if rules is None else rules
    return jax.tree.map(lambda a: spec(a, rules), logical_axes,
                        is_leaf=lambda a: isinstance(a, tuple))


def named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, P))
