"""The tick executor's stash: what each microbatch in flight keeps for its backward.

A stash slot holds, one at a time, several lists of arrays of different shapes (a
chunk's VJP residuals, then with a split backward the weight ops' output gradients
that B writes over the dead residuals), so it is one buffer per dtype and varying type
rather than one per array (`Packing`): a microbatch in flight then holds no more than
the larger of the lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from framework.parallel.pipeline.comm import zeros_typed_like

LANE = 128  # a stash row is [elements / LANE, LANE]: see `Packing`


def _key(a) -> str:
    """Arrays of one key share a buffer: same dtype and same varying mesh axes."""
    return f"{a.dtype}|{','.join(sorted(jax.typeof(a).manual_axis_type.varying))}"


def _lanes(a) -> int:
    """Rows of LANE elements that array `a` takes in a stash row (its tail padded)."""
    return -(-math.prod(a.shape) // LANE)


@dataclass(frozen=True)
class Packing:
    """Several lists of arrays stored, one list at a time, in one buffer per key (dtype
    and device-varying type, which the VJPs need back exactly): [slots, rows, LANE],
    each array from a row of its own. Not [slots, elements]: TPUs tile an array's last
    two dimensions, so a small slot count there is padded (9 slots of a Llama-3-8B stage
    took 16 slots' memory, 16 GiB instead of 9, on the TPU compiler)."""

    rows: dict  # key -> rows of LANE elements

    @staticmethod
    def of(*likes) -> "Packing":
        rows: dict = {}
        for like in likes:
            per: dict = {}
            for a in like:
                per[_key(a)] = per.get(_key(a), 0) + _lanes(a)
            for key, n in per.items():
                rows[key] = max(rows.get(key, 0), n)
        return Packing(rows)

    def zeros(self, n: int, manual: tuple = ()) -> dict:
        """{key: [n, rows, LANE]}, varying over the key's axes and `manual` (the slot a
        cell writes varies over `pipe`, and so does the buffer it writes)."""
        def one(key, rows):
            dtype, axes = key.split("|")
            return zeros_typed_like(jax.ShapeDtypeStruct((n, rows, LANE), dtype), manual,
                                    axes.split(",") if axes else ())
        return {key: one(key, rows) for key, rows in self.rows.items()}

    def store(self, stash: dict, leaves, slot, like) -> dict:
        """Writes `leaves` into slot `slot` of the stash, each at its row: no copy into
        one array first. `like`: their types as traced, which name their buffers (a
        leaf may vary over more axes after a conditional)."""
        at = dict.fromkeys(self.rows, 0)
        stash = dict(stash)
        for a, t in zip(leaves, like, strict=True):
            key, n = _key(t), _lanes(a)
            flat = a.reshape(-1)
            if flat.size % LANE:
                flat = jnp.pad(flat, (0, n * LANE - flat.size))
            stash[key] = jax.lax.dynamic_update_slice(
                stash[key], flat.reshape(1, n, LANE), (slot, at[key], 0))
            at[key] += n
        return stash

    def read(self, stash: dict, slot, like) -> list:
        """Arrays shaped like `like`, read from slot `slot` of the stash at their rows
        (only what is asked for is copied out of the slot)."""
        at = dict.fromkeys(self.rows, 0)
        out = []
        for a in like:
            key, n = _key(a), _lanes(a)
            rows = jax.lax.dynamic_slice(stash[key], (slot, at[key], 0), (1, n, LANE))
            out.append(rows.reshape(-1)[:math.prod(a.shape)].reshape(a.shape))
            at[key] += n
        return out


