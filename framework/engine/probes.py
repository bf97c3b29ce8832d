"""What rides a zero probe's gradient in a train step: the MoE routers' statistics
(framework/engine/moe_stats.py) and FP8's of the layers' matmuls, with delayed
scaling's exponents (framework/engine/fp8_probe.py), each where the layout has it; a
MoE model with `model.fp8` has both.

Each kind adds its probes to the step's params, takes their gradients back out,
reduces them over the mesh, turns them into metrics and moves parameters with them
after the update (MoE's balancing bias, FP8's histories). Here they are composed: the
step's third output is {kind: that kind's statistics} ("moe", "fp8"), and the engine
(framework/engine/step.py) asks this module alone.
"""

from __future__ import annotations

from functools import partial

from framework.engine import fp8_probe, moe_stats
from framework.engine.resolved import Layout

KINDS = {"moe": moe_stats, "fp8": fp8_probe}  # (MoE's first: FP8's wraps the params)


def kinds(layout: Layout) -> list[str]:
    """The kinds this layout's step carries, in `KINDS` order."""
    return [k for k, m in KINDS.items() if m.enabled(layout)]


def with_probes(params, layout: Layout, current: bool = False):
    """This device's params with every kind's zero probes (`current`: FP8's filling
    step, framework/model/fp8_delayed.py)."""
    for kind in kinds(layout):
        params = KINDS[kind].with_probe(params, layout, current)
    return params


def take_probes(grads, layout: Layout):
    """(gradients without the probes', {kind: its probes' gradients})."""
    found = {}
    for kind in reversed(kinds(layout)):
        grads, found[kind] = KINDS[kind].take_probe(grads)
    return grads, found


def reduce(found: dict, layout: Layout) -> dict:
    return {kind: KINDS[kind].reduce(g, layout) for kind, g in found.items()}


def metrics(found: dict, layout: Layout) -> dict:
    """Every kind's metrics (`moe/`, `fp8/`) from the step's reduced statistics."""
    out = {}
    for kind, stats in found.items():
        out.update(KINDS[kind].metrics(stats, layout))
    return out


def _updates(layout: Layout) -> list:
    """(kind, its `mover`) of each kind whose statistics move parameters."""
    moves = [(k, KINDS[k].mover(layout)) for k in kinds(layout)]
    return [(k, move) for k, move in moves if move]


def update(params, found: dict, layout: Layout):
    """The params after the optimizer's update, moved by the step's statistics: the MoE
    balancing bias (framework/model/router.py), FP8's delayed-scaling histories."""
    for kind, move in _updates(layout):
        params = move(params, found[kind], layout)
    return params


def stats_update(layout: Layout):
    """`update` for this layout, or None where nothing moves."""
    return partial(update, layout=layout) if _updates(layout) else None
