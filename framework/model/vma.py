"""Inside a `shard_map` (check_vma) every value is typed by the mesh axes it varies over.
A custom VJP must hand back cotangents typed like its primals, so the model's custom
VJPs (FP8 matmuls, the chunked loss) meet their operands' types here: either
before the call (`alike`: the operands cast to the axes either varies over, whose
transpose autodiff sums, as for a plain einsum's implicit broadcast) or in the backward
(`sum_to`). Outside a shard_map nothing varies and both are identities."""

from __future__ import annotations

import jax


def varying(x) -> frozenset:
    """The mesh axes x varies over (inside a shard_map; empty outside)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def alike(*arrays):
    """The arrays typed as varying over the same mesh axes (the union of theirs)."""
    axes = frozenset().union(*(varying(a) for a in arrays))

    def cast(a):
        missing = tuple(sorted(axes - varying(a)))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return tuple(cast(a) for a in arrays)


def sum_to(ct, primal):
    """A cotangent summed over the mesh axes it varies over and `primal` does not: the
    transpose of the implicit broadcast that met `primal` with a varying operand (a
    vocabulary slice's share of dx is summed over `tensor`, as autodiff would)."""
    axes = tuple(sorted(varying(ct) - varying(primal)))
    return jax.lax.psum(ct, axes) if axes else ct
