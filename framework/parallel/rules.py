"""The one table that maps the model's logical axes onto the (pipe, data, context, tensor)
mesh.

    stage -> pipe                              (pipeline.layout stacks stages on axis 0)
    heads, kv_heads, mlp, vocab -> tensor      (Megatron column/row-parallel weights;
                                                `parallel.tensor_split` picks which)
    experts -> expert                          (expert parallelism only, parallel.expert>1:
                                                framework/parallel/expert.py)
    everything else (embed, head_dim, norm, layers, chunk, qkv, gate_up,
        router_experts) -> replicated
        (so Qwen2's q/k/v biases [kv_heads, qkv, head_dim] split with their heads, and
        Qwen3's q/k norm scales [norm] are replicated: framework/model/llama.py)

`data` is not in the table: parameters are replicated over `data` (or, with ZeRO-1,
sharded along one free dimension per leaf, chosen in `framework/parallel/data.py`),
and the batch is split over `data` by the engine's shard_map.

This table is the whole tensor-parallel plan: the engine's shard_map specs, the model's
per-device weight shapes and the places of Megatron's collectives
(`framework/parallel/tensor.py`), and the memory and communication models all read it.
A rule the model cannot run (e.g. attention's heads split but not its kv heads) raises
`PlanError` when the engine is built.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from framework.config import TENSOR_SPLITTABLE
from framework.parallel.mesh import EXPERT, PIPE, TENSOR
from framework.parallel.pipeline.layout import STAGE

Rules = tuple[tuple[str, str], ...]  # (logical axis, mesh axis); unlisted: replicated


def param_rules(tensor_split: tuple[str, ...] = TENSOR_SPLITTABLE, expert: int = 1) -> Rules:
    """The table for these logical axes split over `tensor` (`parallel.tensor_split`),
    and with expert parallelism (`expert` > 1) the MoE experts over `expert`."""
    rules = ((STAGE, PIPE),) + tuple((name, TENSOR) for name in tensor_split)
    return rules + (("experts", EXPERT),) if expert > 1 else rules


def is_expert_leaf(spec: P) -> bool:
    """A parameter sharded along its `experts` dimension over `expert` (a MoE layer's
    experts under expert parallelism): its gradient is summed over `data` only."""
    return any(part == EXPERT for part in spec)


def spec(axes: tuple[str, ...], rules: Rules) -> P:
    """Logical axis names -> PartitionSpec over mesh axes (unknown names: replicated)."""
    table = dict(rules)
    return P(*(table.get(name) for name in axes))


def param_specs(logical_axes, rules: Rules | None = None):
    rules = param_rules() if rules is None else rules
    return jax.tree.map(lambda a: spec(a, rules), logical_axes,
                        is_leaf=lambda a: isinstance(a, tuple))


def named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, P))
