"""The train state in the canonical, mesh-independent layout that checkpoints store.

Train layout (`framework/pipeline/layout.py`): each layer leaf is
[stage@pipe, chunk, layers_per_chunk, ...]. Canonical layout: [layers, ...], one
`layers` axis, no stage or chunk axis, for the parameters and for every optimizer
leaf that mirrors them (AdamW mu/nu, found by tree structure). `canonical_shardings`
keeps every mesh axis a leaf had (tensor, data under ZeRO-1, and pipe on the layers
axis where the layers of a rank stay contiguous), so saving and restoring move no more
data than each device already holds, except for interleaved (circular) chunks.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from framework.engine import Engine, abstract_train_params
from framework.pipeline import layout


def _map_params(tree, params_def, fn: Callable):
    """Applies `fn` to every subtree of `tree` shaped like the parameters (treedef
    `params_def`): the parameters themselves and each optimizer moment (mu, nu)."""
    is_params = lambda x: jax.tree.structure(x) == params_def
    return jax.tree.map(lambda x: fn(x) if is_params(x) else x, tree, is_leaf=is_params)


def to_canonical(state):
    """Train-layout state -> canonical state (parameters and moments: stages -> layers)."""
    train_def = jax.tree.structure(state["params"])
    return {"params": layout.train_to_canonical(state["params"]),
            "opt_state": _map_params(state["opt_state"], train_def, layout.train_to_canonical),
            "step": state["step"]}


def to_train(engine: Engine, canonical):
    """Inverse of `to_canonical` for this engine's (pipeline, chunks)."""
    split = lambda p: layout.canonical_to_train(p, engine.parallel.pipeline, engine.n_chunks)
    canonical_def = jax.tree.structure(canonical["params"])
    return {"params": split(canonical["params"]),
            "opt_state": _map_params(canonical["opt_state"], canonical_def, split),
            "step": canonical["step"]}


def _layers_spec(spec: P, shape: tuple[int, ...], mesh_shape: dict) -> P:
    """Spec of a canonical [layers, ...] leaf from its stage-layout spec.

    Stage leaves are [stage@pipe, chunk, layers_per_chunk, ...]; the canonical layers
    axis is the merge of (chunk, stage, layers_per_chunk), major to minor. A merged axis
    can only be split into contiguous blocks, so a factor's mesh axis is kept while every
    more-major factor has size 1 or is split into single elements; the rest is
    replicated along `layers` (e.g. the circular schedule's interleaved chunks).
    """
    parts = tuple(spec) + (None,) * (len(shape) - len(spec))
    factors = ((shape[1], parts[1]), (shape[0], parts[0]), (shape[2], parts[2]))
    axes, contiguous = [], True
    for size, axis in factors:
        if axis is None:
            contiguous = contiguous and size == 1
            continue
        if not contiguous:
            break
        axes.append(axis)
        contiguous = size == mesh_shape[axis]
    lead = None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
    return P(lead, *parts[3:])


def canonical_shardings(engine: Engine):
    """NamedShardings of the canonical state on `engine`'s mesh (same tree as
    `to_canonical`'s output)."""
    mesh = engine.mesh
    train = engine.state_shardings
    shapes = abstract_train_params(engine.model, engine.parallel.pipeline, engine.n_chunks)

    def params(shardings):
        layers = jax.tree.map(
            lambda sh, s: NamedSharding(mesh, _layers_spec(sh.spec, s.shape, dict(mesh.shape))),
            shardings["stages"], shapes["stages"])
        return {**{k: v for k, v in shardings.items() if k != "stages"}, "layers": layers}

    train_def = jax.tree.structure(train["params"])
    return {"params": params(train["params"]),
            "opt_state": _map_params(train["opt_state"], train_def, params),
            "step": NamedSharding(mesh, P())}


def abstract_canonical_state(engine: Engine):
    """ShapeDtypeStructs (with this engine's canonical shardings) of the saved state."""
    def init(params):
        return {"params": params, "opt_state": engine.optimizer.init(params),
                "step": jnp.zeros((), jnp.int32)}
    shapes = abstract_train_params(engine.model, engine.parallel.pipeline, engine.n_chunks)
    canonical = jax.eval_shape(lambda p: to_canonical(init(p)), shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        canonical, canonical_shardings(engine))
