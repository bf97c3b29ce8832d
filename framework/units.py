"""Units and byte counts, defined once: every module that sizes or prints memory, bytes
on a link or a tree of arrays reads them here.

Binary units (KiB, MiB, GiB) for memory, as XLA's buffer assignment and the devices'
allocators count it; decimal GB for link bandwidths and vendors' figures (NVLink's 900
GB/s, a 400 Gb/s InfiniBand link: 50 GB/s).
"""

from __future__ import annotations

import math

KIB, MIB, GIB = 2**10, 2**20, 2**30
GB = 1e9  # decimal: bandwidths (bytes/s) and vendors' data sheets
TB = 1e12
FP32 = 4  # bytes of a float32: gradient sums, logits, the optimizer's arithmetic


def dtype_bytes(dtype) -> int:
    """Bytes of one element of `dtype` (a name such as "bfloat16", or a dtype)."""
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def tree_bytes(tree) -> int:
    """Bytes of every array (or ShapeDtypeStruct) leaf of a tree."""
    import jax

    return sum(math.prod(a.shape) * dtype_bytes(a.dtype) for a in jax.tree.leaves(tree))


def gib(nbytes: float, digits: int = 1) -> str:
    """A size as a user reads it: `12.3 GiB`."""
    return f"{nbytes / GIB:.{digits}f} GiB"


def size(nbytes: float) -> str:
    """GiB from a tenth of one up (two decimals), MiB below: small models' memory stays
    readable."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / MIB:.1f} MiB"


def memory_unit(largest: float) -> tuple[int, str]:
    """(unit, its name) for a table whose largest entry is `largest` bytes: GiB from 1
    GiB up, else MiB."""
    return (GIB, "GiB") if largest >= GIB else (MIB, "MiB")
