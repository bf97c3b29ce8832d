"""Where each layer lives: canonical [layers, ...] <-> stage layout [stage, chunk, layer, ...].

With `n_stages` pipeline ranks and `n_chunks` chunks per rank (1 for GPipe and 1F1B,
`virtual_stages` for the circular schedule), layer chunk c = v * n_stages + s holds
layers [c * Lc, (c + 1) * Lc) and lives on rank s as its v-th chunk (Megatron-LM's
interleaved assignment, Narayanan et al. 2021). A V-shaped schedule (`v_shape`, ZB-V:
rank s holds stages s and 2p-1-s, `schedule.stage_map`) keeps chunk 0 so and holds the
chunks of its second half in reverse rank order. Axis 0 of the stage layout is sharded
over `pipe`; checkpoints always use the canonical layout, so they are mesh-independent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

STAGE, CHUNK = "stage", "chunk"  # the logical axes the stage layout adds (STAGE -> pipe)


def _v_flip(x, v_shape: bool):
    """[stage, chunk, ...]: chunk 1's stages in reverse order (its own inverse)."""
    if not v_shape:
        return x
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.concatenate([x[:, :1], x[::-1, 1:]], axis=1)


def to_stages(layers, n_stages: int, n_chunks: int, v_shape: bool = False):
    """[L, ...] -> [n_stages, n_chunks, L / (n_stages * n_chunks), ...]."""

    def one(x):
        lc = x.shape[0] // (n_stages * n_chunks)
        x = x.reshape((n_chunks, n_stages, lc) + x.shape[1:])
        return _v_flip(x.swapaxes(0, 1), v_shape)

    return jax.tree.map(one, layers)


def to_layers(stages, v_shape: bool = False):
    """Inverse of `to_stages`: [n_stages, n_chunks, Lc, ...] -> [L, ...]."""

    def one(x):
        x = _v_flip(x, v_shape).swapaxes(0, 1)
        return x.reshape((-1,) + x.shape[3:])

    return jax.tree.map(one, stages)


def stage_axes(layer_axes):
    """Logical axes of the stage layout: ('layers', ...) -> ('stage', 'chunk', 'layers', ...)."""
    return jax.tree.map(lambda a: (STAGE, CHUNK) + a, layer_axes,
                        is_leaf=lambda a: isinstance(a, tuple))


def canonical_to_train(params, n_stages: int, n_chunks: int, v_shape: bool = False):
    """{'embed', 'layers', 'head'} -> {'embed', 'stages', 'head'}."""
    out = {k: v for k, v in params.items() if k != "layers"}
    out["stages"] = to_stages(params["layers"], n_stages, n_chunks, v_shape)
    return out


def train_to_canonical(params, v_shape: bool = False):
    out = {k: v for k, v in params.items() if k != "stages"}
    out["layers"] = to_layers(params["stages"], v_shape)
    return out


def train_axes(canonical_axes):
    out = {k: v for k, v in canonical_axes.items() if k != "layers"}
    out["stages"] = stage_axes(canonical_axes["layers"])
    return out
