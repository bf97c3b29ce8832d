"""Is a checkpoint what was saved? Fingerprints of every array, damaged or superseded
step folders moved aside (never deleted), and one-line reasons for storage errors.

Orbax notices a truncated data file, a missing OCDBT manifest or a missing item, but
not flipped bytes: measured here (orbax-checkpoint 0.12.8), a data file with one byte
inverted, or 64 random bytes written into it, restored without an error and with other
values. So every save also records a *fingerprint* of each array in the step's JSON
metadata (inside the same atomic step folder), and a restore recomputes it and compares.

Fingerprint of an array x with n elements, each read as its raw bits u_i (uint32; 16-bit
types widened), i its row-major index, all arithmetic modulo 2^32:

    a = sum_i u_i * (2i + 1)                    b = sum_i (u_i xor (u_i >> 16)) * (c*i | 1)

with c = 0x9E3779B1 (Knuth's multiplicative hash constant). Each weight is odd, hence
invertible modulo 2^32, so any change to a single element (any number of its bits)
changes both sums; changes to several elements cancel in both only by chance (about
2^-64). Integer sums are exact in any order, so the fingerprint is the same whatever
the layout the array is sharded in, and it is computed where the array lives, on the
devices (a reduction per array; no copy to the host, no gather across processes).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

_GOLDEN = 0x9E3779B1


def _bits(x: jax.Array) -> jax.Array:
    """The raw bits of x as uint32 (64-bit types: a trailing axis of two words)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = x.dtype.itemsize
    if width == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if width in (1, 2):
        unsigned = {1: jnp.uint8, 2: jnp.uint16}[width]
        return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: [..., 2]


def fingerprint(x: jax.Array) -> jax.Array:
    """[2] uint32: the sums a and b of the module docstring."""
    u = _bits(x)
    index = jnp.zeros(u.shape, jnp.uint32)  # row-major index, built from iotas (no reshape)
    stride = 1
    for axis in reversed(range(u.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, u.shape, axis) * jnp.uint32(stride)
        stride = (stride * u.shape[axis]) % (1 << 32)
    a = jnp.sum(u * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
    mixed = u ^ (u >> jnp.uint32(16))
    b = jnp.sum(mixed * ((index * jnp.uint32(_GOLDEN)) | jnp.uint32(1)), dtype=jnp.uint32)
    return jnp.stack([a, b])


def _key(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def fingerprints(nested: dict) -> dict:
    """{"params/embed/table": [2] uint32, ...} for every array of a nested dict."""
    leaves = jax.tree_util.tree_flatten_with_path(nested)[0]
    return {_key(path): fingerprint(leaf) for path, leaf in leaves}


def dtypes(nested) -> dict:
    """{"params/embed/table": "float32", ...}: the dtype of each array of a nested dict
    (of arrays, or of Orbax's metadata of a saved step)."""
    leaves = jax.tree_util.tree_flatten_with_path(nested)[0]
    return {_key(path): str(leaf.dtype) for path, leaf in leaves}


def as_saved(nested: dict, saved: dict) -> dict:
    """Abstract arrays (ShapeDtypeStructs) with the dtypes they were saved as (`saved`:
    `dtypes` of the step), so they are read unchanged and their fingerprints checked
    before any cast (a run may restore them as another: optim.param_dtype, mu_dtype)."""
    def one(path, leaf):
        dtype = saved.get(_key(path), leaf.dtype)
        return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)

    return jax.tree_util.tree_map_with_path(one, nested)


def array_keys(nested: dict) -> list[str]:
    return [_key(path) for path, _ in jax.tree_util.tree_flatten_with_path(nested)[0]]


def to_json(prints: dict) -> dict:
    """Fingerprints (device arrays) -> {key: [a, b]} of Python ints."""
    host = jax.device_get(prints)
    return {k: [int(v) for v in np.asarray(host[k])] for k in sorted(host)}


def missing(saved: dict | None, expected: list[str]) -> list[str]:
    """Expected arrays the checkpoint's fingerprint list does not name ([] when the
    checkpoint predates fingerprints)."""
    if not saved:
        return []
    return [k for k in expected if k not in saved]


def mismatched(saved: dict | None, restored: dict) -> list[str]:
    """Arrays whose restored fingerprint differs from the saved one."""
    if not saved:
        return []
    got = to_json(restored)
    return [k for k in got if k in saved and list(saved[k]) != got[k]]


def tree_bytes(tree) -> int:
    """Bytes of every array of a (possibly abstract) tree: what a checkpoint stores."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def free_bytes(directory: str) -> int | None:
    """Free bytes where `directory` is (None for remote paths); its nearest existing
    ancestor is measured when it does not exist yet."""
    if "://" in directory:
        return None
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def megabytes(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 1e6:,.1f} MB"


def set_aside(directory: str, name: str, label: str) -> str:
    """Renames `<directory>/<name>` to `<name>.<label>` (or `<name>.<label>-2`, ... if
    taken); returns the new path. Nothing is deleted."""
    src = epath.Path(directory) / name
    for k in itertools.count(1):
        dst = src.parent / (f"{name}.{label}" if k == 1 else f"{name}.{label}-{k}")
        if not dst.exists():
            src.rename(dst)
            return str(dst)
    raise AssertionError("unreachable")


_OS_ERROR = re.compile(r"os_error_code='?(\d+)")
_SPEC = re.compile(r"\s*\[tensorstore_spec.*$|\s*See full TensorStore details.*$")


def short_reason(err: BaseException, limit: int = 200) -> str:
    """One line for an exception from Orbax/TensorStore: the OS error when there is one
    (No space left on device, Permission denied, Disk quota exceeded, ...), else the
    first line of the message without TensorStore's JSON spec."""
    text = str(err)
    found = _OS_ERROR.search(text)
    if found:
        code = int(found.group(1))
        return f"{os.strerror(code)} (errno {code})"
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror} (errno {err.errno})"
    first = (text.strip().splitlines() or [type(err).__name__])[0]
    first = _SPEC.sub("", first)
    if len(first) > limit:
        first = first[:limit] + "..."
    return f"{type(err).__name__}: {first}"


def at(nested: dict, key: str, make: bool = False) -> tuple[dict, str]:
    """(the dict holding the array `key` names ('params/layers/...'), its last name);
    `make`: the dicts on the way are made where missing."""
    *parents, last = key.split("/")
    for name in parents:
        nested = nested.setdefault(name, {}) if make else nested[name]
    return nested, last


def without(nested: dict, keys: list[str]) -> dict:
    """A nested dict without the arrays `keys` name."""
    out = jax.tree.map(lambda x: x, nested)
    for key in keys:
        node, last = at(out, key)
        del node[last]
    return out


def with_zeros(restored: dict, abstract: dict, keys: list[str]) -> dict:
    """`restored` with zeros for the arrays `keys` name, shaped, typed and sharded as
    `abstract` (nested ShapeDtypeStructs) says."""
    for key in keys:
        node, last = at(restored, key, make=True)
        s = at(abstract, key)[0][last]
        node[last] = jax.jit(lambda s=s: jnp.zeros(s.shape, s.dtype), out_shardings=s.sharding)()
    return restored
