"""Reading and writing safetensors files, and Hugging Face's sharded index, without the
`safetensors` package.

The format: an 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the tensors' raw little-endian bytes, back to back (offsets are relative to the
end of the header, cover the data without gaps, and the header is padded with spaces
to a multiple of 8 bytes). bfloat16 comes from `ml_dtypes`, which JAX depends on.

Reading memory-maps each file and copies only the slices asked for, so a process that
places its devices' shards of a model reads (and holds) those slices, not the model;
`bytes_read` counts what was copied. A damaged or truncated file is a one-line
`ConfigError`, as is a full disk while writing (files are written to a temporary name
and renamed, so a failed write leaves no half file under the real name).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from framework.errors import ConfigError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
          "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
          "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER = 100 << 20  # the reference implementation refuses larger headers too


class SafetensorsFile:
    """One .safetensors file, memory-mapped; `read(name, index)` copies a slice."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.bytes_read = 0
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise ConfigError(f"{self.path} is not a safetensors file (header length "
                                  f"{n}, file size {size})")
            try:
                header = json.loads(f.read(n))
            except ValueError as err:
                raise ConfigError(f"{self.path}: damaged safetensors header ({err})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + n
        self.tensors = {}
        for name, info in header.items():
            try:
                dtype = np.dtype(DTYPES[info["dtype"]])
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ConfigError(f"{self.path}: tensor {name!r} has an unreadable or "
                                  f"unsupported entry {info!r}") from None
            if end - begin != dtype.itemsize * int(np.prod(shape)) or \
                    self.data_start + end > size or begin < 0:
                raise ConfigError(f"{self.path}: tensor {name!r} ({info['dtype']} {list(shape)}) "
                                  f"does not fit its offsets {begin}..{end} in a file of "
                                  f"{size} bytes (truncated or damaged)")
            self.tensors[name] = (dtype, shape, begin)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self.data_start \
            else np.zeros(0, np.uint8)

    def view(self, name: str) -> np.ndarray:
        """The whole tensor as a read-only memory-mapped array (nothing is read yet)."""
        dtype, shape, begin = self.tensors[name]
        return np.ndarray(shape, dtype, buffer=self._map, offset=self.data_start + begin)

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        """A copy of tensor[index] (basic slicing), reading only those bytes."""
        out = np.array(self.view(name)[index])
        self.bytes_read += out.nbytes
        return out


class Tensors:
    """The tensors of a Hugging Face folder: `model.safetensors`, or the files listed by
    `model.safetensors.index.json` (sharded), by name."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        index = folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{index} is not a safetensors index (no weight_map)") from None
            names = sorted(set(weight_map.values()))
        elif (folder / SINGLE_FILE).is_file():
            weight_map, names = None, [SINGLE_FILE]
        else:
            raise ConfigError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ConfigError(f"{folder}: {INDEX_FILE} lists {missing[0]}, which is missing")
        self.files = {n: SafetensorsFile(folder / n) for n in names}
        self.where = {}
        for file_name, f in self.files.items():
            for name in f.tensors:
                self.where[name] = f
        if weight_map is not None:
            for name, file_name in weight_map.items():
                if name not in self.files[file_name].tensors:
                    raise ConfigError(f"{folder}: {INDEX_FILE} puts {name} in {file_name}, "
                                      f"which does not hold it")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).tensors[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self._file(name).tensors[name][0]

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        return self._file(name).read(name, index)

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self.where:
            raise ConfigError(f"tensor {name} is missing from the safetensors files "
                              f"({', '.join(sorted(self.files))})")
        return self.where[name]

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files.values())


# --- Writing ---------------------------------------------------------------------------

def header_bytes(entries: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict) -> bytes:
    """The length-prefixed, space-padded JSON header for tensors stored in this order."""
    header, offset = {}, 0
    for name, dtype, shape in entries:
        n = np.dtype(dtype).itemsize * int(np.prod(shape))
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def write_file(path: str | Path, tensors, metadata: dict | None = None) -> int:
    """Writes `tensors`, a list of (name, shape, dtype, make) where `make()` returns the
    array (called one tensor at a time, so the caller need not hold them all). Returns
    the bytes of tensor data written. Metadata defaults to {"format": "pt"}, which
    transformers requires."""
    path = Path(path)
    entries = [(name, np.dtype(dtype), tuple(shape)) for name, shape, dtype, _ in tensors]
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    try:
        with open(tmp, "wb") as f:
            f.write(header_bytes(entries, metadata or {"format": "pt"}))
            for (name, dtype, shape), (_, _, _, make) in zip(entries, tensors):
                array = np.ascontiguousarray(make(), dtype=dtype)
                if array.shape != shape:
                    raise ValueError(f"{name}: made {array.shape}, declared {shape}")
                f.write(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
                written += array.nbytes
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"could not write {path}: {err.strerror or err}") from None
    return written


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensors (in order) grouped into files of at most `max_bytes` each (a tensor larger
    than that gets a file of its own), as transformers' save_pretrained does."""
    shards, current, used = [], [], 0
    for name, n in sizes:
        if current and used + n > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current:
        shards.append(current)
    return shards


def write_folder(folder: str | Path, tensors, max_shard_bytes: int) -> list[str]:
    """Writes `tensors` (as in write_file) into `folder` as model.safetensors, or, past
    `max_shard_bytes`, as model-0000i-of-0000n.safetensors plus the index transformers
    reads. Returns the file names written."""
    folder = Path(folder)
    sizes = [(name, np.dtype(dtype).itemsize * int(np.prod(shape)))
             for name, shape, dtype, _ in tensors]
    groups = plan_shards(sizes, max_shard_bytes)
    by_name = {t[0]: t for t in tensors}
    if len(groups) == 1:
        write_file(folder / SINGLE_FILE, tensors)
        (folder / INDEX_FILE).unlink(missing_ok=True)
        return [SINGLE_FILE]
    names, weight_map = [], {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_file(folder / name, [by_name[n] for n in group])
        names.append(name)
        weight_map.update({n: name for n in group})
    index = {"metadata": {"total_size": sum(n for _, n in sizes)}, "weight_map": weight_map}
    try:
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    except OSError as err:
        raise ConfigError(f"could not write {folder / INDEX_FILE}: {err.strerror or err}") from None
    (folder / SINGLE_FILE).unlink(missing_ok=True)
    return names + [INDEX_FILE]
