"""Inside a `shard_map` (check_vma) every value is typed by the mesh axes it varies over.
Values that meet (a conditional's branches, a loop's carry, a custom VJP's cotangents
and primals, an output buffer and what is written into it) must agree on that type;
this module is the one place that casts a value to vary over more axes (`cast`, `like`,
`alike`: a `pcast`, whose transpose autodiff sums, as for a plain einsum's implicit
broadcast) or sums a cotangent back to its primal's (`sum_to`). Outside a shard_map
nothing varies and all are identities. The model's custom VJPs (FP8 matmuls, the
chunked loss) and the parallel executors (the tick loop, skipped stages, the expert
exchange, tensor parallelism's f) all read it."""

from __future__ import annotations

import jax


def varying(x) -> frozenset:
    """The mesh axes x varies over (inside a shard_map; empty outside)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def cast(x, axes):
    """x typed as varying over `axes` too (cast over those it does not vary over yet)."""
    missing = tuple(sorted(frozenset(axes) - varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def like(x, other):
    """x (varying over no more than `other`) typed as varying over what `other` does."""
    return cast(x, varying(other))


def alike(*arrays):
    """The arrays typed as varying over the same mesh axes (the union of theirs)."""
    axes = frozenset().union(*(varying(a) for a in arrays))
    return tuple(cast(a, axes) for a in arrays)


def sum_to(ct, primal):
    """A cotangent summed over the mesh axes it varies over and `primal` does not: the
    transpose of the implicit broadcast that met `primal` with a varying operand (a
    vocabulary slice's share of dx is summed over `tensor`, as autodiff would)."""
    axes = tuple(sorted(varying(ct) - varying(primal)))
    return jax.lax.psum(ct, axes) if axes else ct
