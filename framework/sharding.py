"""The one table that maps the model's logical axes onto the (pipe, data, tensor) mesh.

Parameters (stored, outside the pipeline):
    stage -> pipe                                  (pipeline.layout stacks stages on axis 0)
    heads, kv_heads, mlp, vocab -> tensor          (Megatron column/row-parallel)
    everything else (embed, head_dim, norm, layers, chunk) -> replicated
Activations (inside the pipeline, where `pipe` and `data` are already manual):
    heads, kv_heads, mlp, vocab -> tensor
    seq -> tensor with sequence parallelism (Korthikanti et al. 2022), else replicated
    seq_full -> replicated (attention and MLP need the whole sequence)
`data` never appears here: batch splitting over `data` is done by the shard_map in
`framework/engine.py` and gradient averaging by `framework/data_parallel.py`.
"""

from __future__ import annotations

import contextlib

import jax
import flax.linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

TENSOR_SHARDED = ("heads", "kv_heads", "mlp", "vocab")


def param_rules() -> tuple[tuple[str, str | None], ...]:
    return (("stage", "pipe"),) + tuple((name, "tensor") for name in TENSOR_SHARDED)


def activation_rules(sequence_parallel: bool) -> tuple[tuple[str, str | None], ...]:
    rules = tuple((name, "tensor") for name in TENSOR_SHARDED)
    rules += (("batch", None), ("seq_full", None), ("embed", None), ("head_dim", None))
    return rules + (("seq", "tensor" if sequence_parallel else None),)


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


@contextlib.contextmanager
def activation_sharding(mesh, sequence_parallel: bool):
    """Inside this context the model's `constrain(x, logical_axes)` calls become
    sharding constraints over the mesh's automatic axis (`tensor`)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(activation_rules(sequence_parallel)):
        yield
