"""Where each layer lives: canonical [layers, ...] <-> stage layout [stage, chunk, layer, ...].

With `n_stages` pipeline ranks and `n_chunks` chunks per rank (1 for GPipe and 1F1B,
`virtual_stages` for the circular schedule), layer chunk c = v * n_stages + s holds
layers [c * Lc, (c + 1) * Lc) and lives on rank s as its v-th chunk (Megatron-LM's
interleaved assignment, Narayanan et al. 2021); a V-shaped schedule (`v_shape`, ZB-V)
places them in a V: both read the one stage map (`table.stage_map`). Uneven stages (`stage_layers`, the
real layers of each global stage) pad every chunk to the longest with zero layers,
which the model's layer scan skips (`stage.skip_unless`). Axis 0 of the stage layout is sharded
over `pipe`; checkpoints always use the canonical layout, so they are mesh-independent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from framework.parallel.pipeline.table import INTERLEAVED, V_SHAPE, StageMap, stage_map

STAGE, CHUNK = "stage", "chunk"  # the logical axes the stage layout adds (STAGE -> pipe)


def _stages(n_stages: int, n_chunks: int, v_shape: bool) -> StageMap:
    return stage_map(V_SHAPE if v_shape else INTERLEAVED, n_stages, n_chunks)


def stage_starts(stage_layers) -> np.ndarray:
    """Uneven stages: [S] the canonical index of each global stage's first layer,
    sum(stage_layers[:g])."""
    return np.concatenate([[0], np.cumsum(np.asarray(stage_layers))[:-1]])


def _padding(stage_layers) -> tuple[np.ndarray, np.ndarray]:
    """Uneven stages: (index into the canonical layers [S, Lc], real [S, Lc]) where
    Lc = max(stage_layers) and global stage g holds layers sum(stage_layers[:g]) + i
    for i < stage_layers[g], padding after."""
    n = np.asarray(stage_layers)
    lc, start = int(n.max()), stage_starts(n)
    i = np.arange(lc)[None, :]
    real = i < n[:, None]
    return np.where(real, start[:, None] + i, 0), real


def to_stages(layers, n_stages: int, n_chunks: int, v_shape: bool = False,
              stage_layers=None):
    """[L, ...] -> [n_stages, n_chunks, Lc, ...]: Lc = L / (n_stages * n_chunks), or with
    uneven `stage_layers` (per global stage) their maximum, zeros in the padding."""

    of = _stages(n_stages, n_chunks, v_shape).of  # [ranks, chunks] -> global stage

    def one(x):  # -> [S, Lc, ...] in global-stage order, then [ranks, chunks, Lc, ...]
        if stage_layers is None:
            x = x.reshape((n_stages * n_chunks, -1) + x.shape[1:])
        else:
            index, real = _padding(stage_layers)
            real = real.reshape(real.shape + (1,) * (x.ndim - 1))
            x = (np.where if isinstance(x, np.ndarray) else jnp.where)(real, x[index], 0)
        return x[of]

    return jax.tree.map(one, layers)


def to_layers(stages, v_shape: bool = False, stage_layers=None):
    """Inverse of `to_stages`: [n_stages, n_chunks, Lc, ...] -> [L, ...] (the padding of
    uneven stages dropped)."""

    def one(x):
        stages = _stages(x.shape[0], x.shape[1], v_shape)
        x = x[stages.rank, stages.chunk]  # [S, Lc, ...] in global-stage order
        x = x.reshape((-1,) + x.shape[2:])
        if stage_layers is not None:
            x = x[np.flatnonzero(_padding(stage_layers)[1])]
        return x

    return jax.tree.map(one, stages)


def stage_axes(layer_axes):
    """Logical axes of the stage layout: ('layers', ...) -> ('stage', 'chunk', 'layers', ...)."""
    return jax.tree.map(lambda a: (STAGE, CHUNK) + a, layer_axes,
                        is_leaf=lambda a: isinstance(a, tuple))


def canonical_to_train(params, n_stages: int, n_chunks: int, v_shape: bool = False,
                       stage_layers=None):
    """{'embed', 'layers', 'head'} -> {'embed', 'stages', 'head'}."""
    out = {k: v for k, v in params.items() if k != "layers"}
    out["stages"] = to_stages(params["layers"], n_stages, n_chunks, v_shape, stage_layers)
    return out


def train_to_canonical(params, v_shape: bool = False, stage_layers=None):
    out = {k: v for k, v in params.items() if k != "stages"}
    out["layers"] = to_layers(params["stages"], v_shape, stage_layers)
    return out


def train_axes(canonical_axes):
    out = {k: v for k, v in canonical_axes.items() if k != "layers"}
    out["stages"] = stage_axes(canonical_axes["layers"])
    return out


def balance(n_layers: int, n_stages: int, layer_cost: float, first_cost: float = 0.0,
            last_cost: float = 0.0) -> tuple[int, ...]:
    """Layers per global stage minimising the largest stage cost, where global stage 0
    also pays `first_cost` (the embedding) and the last `last_cost` (the head and the
    loss), each stage at least one layer. Adding layers one at a time where the stage's
    new cost is smallest is optimal for equal layers (the classic greedy for makespan
    with identical jobs)."""
    n = [1] * n_stages
    extra = [0.0] * n_stages
    extra[0] += first_cost
    extra[-1] += last_cost
    for _ in range(n_layers - n_stages):
        g = min(range(n_stages), key=lambda s: ((n[s] + 1) * layer_cost + extra[s], s))
        n[g] += 1
    return tuple(n)
