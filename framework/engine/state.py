"""The train state {params, opt_state, step}: its one constructor and its two layouts.

Train layout: what the step reads and writes. Parameters in the stage layout
(`framework/parallel/pipeline/layout.py`): each layer leaf is
[stage@pipe, chunk, layers_per_chunk, ...], sharded by the logical-axis rules
(`framework/parallel/rules.py`) and, with ZeRO-1, over `data` along one free
dimension per leaf (`framework/parallel/data.py`). AdamW's moments are laid out like
the parameters they track.

Canonical layout: what checkpoints and Hugging Face folders hold, [layers, ...], one
`layers` axis, no stage or chunk axis, for the parameters and for every optimizer leaf
that mirrors them (AdamW mu/nu, found by tree structure). It is mesh-independent: a
checkpoint written under one (pipeline, data, tensor, schedule, zero1) restores under
any other. `StateLayout.canonical_shardings` keeps every mesh axis a leaf had (tensor,
data under ZeRO-1, and pipe on the layers axis where the layers of a rank stay
contiguous), so saving and restoring move no more data than each device already
holds, except for interleaved (circular) chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from framework.config import ModelConfig
from framework.engine.resolved import Layout
from framework.model.prefix import DENSE, stack_layers
from framework.model.registry import spec_of
from framework.parallel import data as data_parallel
from framework.parallel import rules
from framework.parallel.pipeline import layout


def train_state(params, opt_state, step) -> dict:
    """The train state. Every state of the framework is built here."""
    return {"params": params, "opt_state": opt_state, "step": step}


def new_state(params, optimizer: optax.GradientTransformation) -> dict:
    """The state before the first step: a fresh optimizer state, step 0."""
    return train_state(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def as_dtype(params, dtype: str):
    """The parameters stored in `dtype` (optim.param_dtype): every leaf cast; the one
    place the stored dtype is applied (fresh, imported and restored parameters)."""
    return jax.tree.map(lambda x: x.astype(dtype), params)


@lru_cache(maxsize=None)
def abstract_train_params(model: ModelConfig, n_stages: int, n_chunks: int,
                          stage_layers: tuple | None = None, dtype: str = "float32"):
    """Train-layout parameter shapes (jax.ShapeDtypeStruct leaves) stored in `dtype`;
    allocates nothing (traced once per model and layout)."""
    return jax.eval_shape(lambda: as_dtype(layout.canonical_to_train(
        spec_of(model).init_params(model, jax.random.key(0)), n_stages, n_chunks,
        stage_layers=stage_layers), dtype))


def param_specs(lay: Layout):
    """(PartitionSpecs of the train-layout parameters, ZeRO-1's dimension per leaf or
    None without ZeRO-1)."""
    model, parallel, n_chunks = lay.model, lay.parallel, lay.chunks_per_rank
    axes = layout.train_axes(spec_of(model).logical_axes(model))
    specs = rules.param_specs(axes, rules.param_rules(parallel.tensor_split, lay.expert))
    if not ((parallel.zero1 or parallel.fsdp) and parallel.data > 1):
        return specs, None
    shapes = abstract_train_params(model, parallel.pipeline, n_chunks, parallel.stage_layers)
    if parallel.fsdp:  # a dimension of one use: stages are [stage, chunk, layer, ...]
        dims = data_parallel.fsdp_dims(shapes, specs, parallel.data, {"stages": 3},
                                       lay.expert)
        if DENSE in shapes["embed"]:  # a dense prefix, gathered layer by layer: [k, ...]
            dims["embed"][DENSE] = data_parallel.fsdp_dims(
                {DENSE: shapes["embed"][DENSE]}, {DENSE: specs["embed"][DENSE]},
                parallel.data, {DENSE: 1}, lay.expert)[DENSE]
    else:
        dims = data_parallel.zero1_dims(shapes, specs, parallel.data, lay.expert)
    return data_parallel.add_data_axis(specs, dims), dims


def _masked(x) -> bool:
    """A leaf an optimizer partition keeps no state for (Muon's on AdamW's leaves, ...)."""
    return isinstance(x, optax.MaskedNode)


def _map_params(tree, params_def, fn: Callable):
    """Applies `fn` to every subtree of `tree` shaped like the parameters (treedef
    `params_def`): the parameters themselves and each optimizer moment (mu, nu), also
    a moment kept for some leaves only (`optax.MaskedNode` at the others, which `fn`'s
    leaf-wise maps pass over)."""
    is_params = lambda x: jax.tree.structure(x, is_leaf=_masked) == params_def
    return jax.tree.map(lambda x: fn(x) if is_params(x) else x, tree, is_leaf=is_params)


def to_canonical(state, v_shape: bool = False, stage_layers: tuple | None = None):
    """Train-layout state -> canonical state (parameters and moments: stages -> layers)."""
    train_def = jax.tree.structure(state["params"])
    merge = lambda p: layout.train_to_canonical(p, v_shape, stage_layers)
    return train_state(merge(state["params"]), _map_params(state["opt_state"], train_def, merge),
                       state["step"])


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
        axes.extend(axis if isinstance(axis, tuple) else (axis,))
        contiguous = size == (math.prod(mesh_shape[a] for a in axis)  # (data, expert)
                              if isinstance(axis, tuple) else mesh_shape[axis])
    lead = None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
    return P(lead, *parts[3:])


@dataclass(eq=False)
class StateLayout:
    """Where the train state lives for one (model, layout, mesh, optimizer): its
    shardings in both layouts, the conversions between them, and abstract copies
    (shapes and shardings, nothing allocated) for compiling and restoring."""

    resolved: Layout  # the configuration's resolved layout (framework/engine/resolved.py)
    mesh: jax.sharding.Mesh
    optimizer: optax.GradientTransformation
    param_specs: dict  # PartitionSpecs of the train-layout parameters
    zero1_dims: dict | None  # ZeRO-1's dimension per leaf (None: no ZeRO-1)
    param_dtype: str = "float32"  # the stored parameters' (optim.param_dtype)

    model = property(lambda self: self.resolved.model)
    parallel = property(lambda self: self.resolved.parallel)
    n_chunks = property(lambda self: self.resolved.chunks_per_rank)  # chunks per rank
    v_shape = property(lambda self: self.resolved.v_shape)  # ZB-V's V: the layers too
    stage_layers = property(lambda self: self.resolved.stage_layers)  # None: even

    def to_canonical(self, state):
        """Train-layout state -> canonical state."""
        return to_canonical(state, self.v_shape, self.stage_layers)

    @property
    def abstract_params(self):
        """Train-layout parameter shapes (ShapeDtypeStruct leaves, no shardings)."""
        return abstract_train_params(self.model, self.parallel.pipeline, self.n_chunks,
                                     self.stage_layers, self.param_dtype)

    @cached_property
    def shardings(self) -> dict:
        """NamedShardings of the train state; optimizer moments exactly like the
        parameters they track, the rest replicated."""
        params = rules.named(self.mesh, self.param_specs)
        replicated = NamedSharding(self.mesh, P())
        like_params = lambda moment: jax.tree.map(
            lambda m, sh: m if _masked(m) else sh, moment, params, is_leaf=_masked)
        opt = _map_params(jax.eval_shape(self.optimizer.init, self.abstract_params),
                          jax.tree.structure(params), like_params)
        opt = jax.tree.map(lambda x: x if isinstance(x, NamedSharding) else replicated, opt)
        return train_state(params, opt, replicated)

    @cached_property
    def canonical_shardings(self) -> dict:
        """NamedShardings of the canonical state (same tree as `to_canonical`'s output)."""
        mesh, train = self.mesh, self.shardings

        def spec(stage_spec, shape):
            out = _layers_spec(stage_spec, shape, dict(mesh.shape))
            lead = out[0] if out and out[0] is not None else ()
            lead = (lead,) if isinstance(lead, str) else lead
            if self.stage_layers is not None and (  # padded stages: does L split evenly?
                    stack_layers(self.model) % math.prod(mesh.shape[a] for a in lead)):
                out = P(None, *out[1:])
            return out

        def params(shardings):
            layers = jax.tree.map(
                lambda sh, s: sh if _masked(sh) else NamedSharding(mesh, spec(sh.spec, s.shape)),
                shardings["stages"], self.abstract_params["stages"], is_leaf=_masked)
            return {**{k: v for k, v in shardings.items() if k != "stages"}, "layers": layers}

        train_def = jax.tree.structure(train["params"])
        return train_state(params(train["params"]),
                           _map_params(train["opt_state"], train_def, params),
                           NamedSharding(mesh, P()))

    def to_train(self, canonical):
        """Inverse of `to_canonical` for this layout's (pipeline, chunks); each array
        cast to this layout's dtype of it (a checkpoint saved with another
        optim.param_dtype or optim.mu_dtype restores cast)."""
        split = lambda p: layout.canonical_to_train(p, self.parallel.pipeline, self.n_chunks,
                                                    self.v_shape, self.stage_layers)
        canonical_def = jax.tree.structure(canonical["params"])
        state = train_state(split(canonical["params"]),
                            _map_params(canonical["opt_state"], canonical_def, split),
                            canonical["step"])
        target = jax.eval_shape(lambda p: new_state(p, self.optimizer), self.abstract_params)
        return jax.tree.map(lambda x, t: x.astype(t.dtype), state, target)

    def place(self, canonical_params):
        """Canonical params on the host (any float dtype) -> train layout in the stored
        dtype, placed on the mesh (each process places its own shards)."""
        params = layout.canonical_to_train(canonical_params, self.parallel.pipeline,
                                           self.n_chunks, self.v_shape, self.stage_layers)
        cast = lambda x: x if x.dtype == self.param_dtype else x.astype(self.param_dtype)
        return jax.device_put(jax.tree.map(cast, params), self.shardings["params"])

    def from_canonical(self, canonical_params):
        """Canonical params already on the mesh (any float dtype) -> train layout in the
        stored dtype (one jitted relayout)."""
        relayout = lambda c: as_dtype(layout.canonical_to_train(
            c, self.parallel.pipeline, self.n_chunks, self.v_shape, self.stage_layers),
            self.param_dtype)
        return jax.jit(relayout, out_shardings=self.shardings["params"])(canonical_params)

    def init(self, params) -> dict:
        """The state before the first step, from train-layout params on the mesh."""
        return jax.jit(lambda p: new_state(p, self.optimizer),
                       out_shardings=self.shardings)(params)

    def abstract_state(self) -> dict:
        """The train state as ShapeDtypeStructs with its shardings."""
        state = jax.eval_shape(lambda p: new_state(p, self.optimizer), self.abstract_params)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            state, self.shardings)

    def abstract_canonical(self) -> dict:
        """The canonical state (what a checkpoint holds) as ShapeDtypeStructs with the
        canonical shardings."""
        canonical = jax.eval_shape(lambda p: self.to_canonical(new_state(p, self.optimizer)),
                                   self.abstract_params)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            canonical, self.canonical_shardings)
