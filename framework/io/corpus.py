"""A sharded token corpus (`data.kind=corpus`): what `tools/prepare_data.py <folder>`
writes, read as fixed-length sequences in epochs without replacement.

On disk, a folder:
    manifest.json          format, tokenizer, vocab_size, dtype, eos_id, and per shard
                           its files, documents, tokens and SHA-256 checksums
    shard-NNNNN.bin        flat token ids (uint16/uint32), documents end to end, each
                           followed by eos_id when the tokenizer has one
    shard-NNNNN.idx        uint64 offsets of the documents in the shard: [n_docs + 1]

Sequences. The shards' tokens are one stream (in manifest order); sequence i is the
window [i L, i L + L + 1) of it (L = train.seq_len: inputs and next-token targets, so
windows overlap by the one token a target needs), packed across document and shard
boundaries. The last `data.holdout_fraction` of the sequences are held out for
`eval/loss`, the rest are trained on.

Epochs without replacement. Training sample g (row r of step s, g = s B + r for a
global batch B) belongs to epoch e = g // n and is sequence perm_e(g mod n) of the n
training sequences: every sequence once per epoch, a new order each epoch. perm_e is a
keyed pseudo-random permutation of [0, n) in O(1) memory (`permute`: a Feistel network
on the next power of two, walking the cycle back into [0, n): Black & Rogaway 2002,
"Ciphers with arbitrary finite domains"), keyed by (seed, epoch). So row r of step s
stays a pure function of (seed, step, row): a resumed run sees the same batches on any
mesh, and a process reads only its own rows, from memory-mapped shards (memory bounded
whatever the corpus size).

Checks before training (one line each, `ConfigError`): a missing manifest or shard, a
manifest a reader does not understand (a key missing or of the wrong type) or one
edited by hand (its `seal`, a SHA-256 of the rest, no longer matches), a shard whose
size or checksum differs from the manifest's (`data.verify=checksum` reads every byte;
`size` only compares sizes), a vocabulary beyond `model.vocab_size`, fewer training
sequences than one batch. During training every read first compares the shard's size
and modification time with those it had at the start (`Shard.check`, `DataError`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from framework.errors import ConfigError, DataError
from framework.io import outputs

MANIFEST = "manifest.json"
FORMAT = 1
ROUNDS = 4  # Feistel rounds: enough mixing for an order of samples, not cryptography


def sha256(path: str, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Shard:
    tokens: np.ndarray  # [n_tokens] memory-mapped ids
    start: int  # its first token's position in the whole stream
    path: str = ""  # its file, and that file's size and modification time when opened
    nbytes: int = 0  # (checked per read)
    mtime_ns: int | None = None

    def check(self) -> None:
        """DataError unless the file still has the size and modification time it had
        when the run opened it: a shard truncated after the start would be read past
        its end (SIGBUS through the memory map), one rewritten in place with other ids
        would be trained on without a word."""
        try:
            st = os.stat(self.path)
        except OSError as err:
            raise DataError(f"{self.path} can no longer be read ({err.strerror}): the corpus "
                            f"changed during the run") from None
        if st.st_size != self.nbytes:
            raise DataError(f"{self.path} is now {st.st_size} bytes, its manifest says "
                            f"{self.nbytes}: the corpus changed during the run")
        if self.mtime_ns is not None and st.st_mtime_ns != self.mtime_ns:
            raise DataError(f"{self.path} was rewritten during the run (its modification "
                            f"time changed): the corpus changed during the run")


def open_corpus(path: str, vocab_size: int, verify: str = "checksum",
                setting: str = "data.path") -> tuple[list[Shard], dict]:
    """(the shards, memory-mapped, in stream order; the manifest) of the corpus at `path`
    (its folder or its manifest.json), checked (module docstring); `setting` names it."""
    is_manifest = os.path.basename(path) == MANIFEST and os.path.isfile(path)
    if not (os.path.isdir(path) or is_manifest):
        raise ConfigError(f"{setting}={path} is not a corpus folder (nor its {MANIFEST}): "
                          f"prepare one with tools/prepare_data.py <folder> <inputs>")
    folder = os.path.dirname(path) if is_manifest else path
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise ConfigError(f"{setting}={path} holds no {MANIFEST}: prepare a corpus with "
                          f"tools/prepare_data.py <folder> <inputs>")
    manifest = read_manifest(manifest_path)
    dtype = np.dtype(manifest["dtype"])
    if manifest["vocab_size"] > vocab_size:
        raise ConfigError(f"{manifest_path}: the corpus's tokenizer has a vocabulary of "
                          f"{manifest['vocab_size']} but model.vocab_size={vocab_size}: "
                          f"set model.vocab_size >= {manifest['vocab_size']}")
    shards, start = [], 0
    for meta in manifest["shards"]:
        for key in ("file", "index"):
            _check_file(os.path.join(folder, meta[key]), meta[f"{key}_bytes"],
                        meta[f"{key}_sha256"], verify)
        where = os.path.join(folder, meta["file"])
        tokens = np.memmap(where, dtype=dtype, mode="r") if meta["file_bytes"] else \
            np.zeros(0, dtype)
        shards.append(Shard(tokens, start, where, meta["file_bytes"],
                            os.stat(where).st_mtime_ns))
        start += len(tokens)
    if not shards or start == 0:
        raise ConfigError(f"{manifest_path} lists no tokens")
    return shards, manifest


SHARD_KEYS = {"file": str, "index": str, "file_bytes": int, "index_bytes": int,
              "file_sha256": str, "index_sha256": str, "tokens": int, "documents": int}


def read_manifest(manifest_path: str) -> dict:
    """The manifest, checked: every key a reader uses, of its type; its seal (written
    with it) intact. ConfigError (one line) naming what is wrong otherwise."""
    again = "prepare the corpus again with tools/prepare_data.py <folder> <inputs>"
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{manifest_path} is not readable JSON ({err}): {again}") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise ConfigError(f"{manifest_path}: {problem}: {again}")
    if "seal" in manifest and manifest["seal"] != seal(manifest):
        raise ConfigError(f"{manifest_path} was edited after the corpus was prepared (its "
                          f"seal no longer matches: eos_id, dtype, tokenizer or shards "
                          f"changed by hand): {again}")
    return manifest


def _manifest_problem(m) -> str | None:
    """What makes `m` not a manifest a reader understands, in words (None: nothing)."""
    if not isinstance(m, dict):
        return "not a JSON object"
    if m.get("dtype") not in ("uint16", "uint32"):
        return f"dtype {m.get('dtype')!r} is not one of uint16, uint32"
    vocab, eos = m.get("vocab_size"), m.get("eos_id")
    if not _is_int(vocab) or vocab < 1:
        return f"vocab_size {vocab!r} is not a whole number >= 1"
    if eos is not None and (not _is_int(eos) or not 0 <= eos < vocab):
        return f"eos_id {eos!r} is not a token id below its vocab_size {vocab}"
    shards = m.get("shards")
    if not isinstance(shards, list):
        return "it lists no shards (a list 'shards')"
    for n, shard in enumerate(shards):
        bad = [k for k, kind in SHARD_KEYS.items() if not isinstance(shard, dict)
               or not isinstance(shard.get(k), kind) or isinstance(shard.get(k), bool)]
        if bad:
            return f"shard {n} lacks {', '.join(bad)} (or has the wrong type)"
        if os.path.basename(shard["file"]) != shard["file"] or \
                os.path.basename(shard["index"]) != shard["index"]:
            return f"shard {n} names a file outside the corpus folder"
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def seal(manifest: dict) -> str:
    """SHA-256 of the manifest without its seal: written with it, checked by readers."""
    body = {k: v for k, v in manifest.items() if k != "seal"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


AGAIN = ("prepare the corpus again with the same command (tools/prepare_data.py prepares "
         "again the inputs whose shards are missing or damaged)")


def _check_file(path: str, size: int, digest: str, verify: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"corpus shard {path} is missing: restore it, or {AGAIN}")
    if os.path.getsize(path) != size:
        raise ConfigError(f"corpus shard {path} is {os.path.getsize(path)} bytes but its "
                          f"manifest says {size}: the file is truncated or was replaced; "
                          f"restore it, or {AGAIN}")
    if verify == "checksum" and sha256(path) != digest:
        raise ConfigError(f"corpus shard {path} does not match its manifest's SHA-256: the "
                          f"file is damaged; restore it, or {AGAIN}")


# --- Writing (tools/prepare_data.py <folder>) -------------------------------------------

def shard_name(source: int, part: int) -> str:
    """Shards are named by the input they come from and their part of it, so that
    workers write them independently and a restart knows which exist."""
    return f"shard-{source:05d}-{part:03d}"


def write_shard(folder: str, name: str, docs: list[np.ndarray], dtype: str) -> dict:
    """Writes `name`.bin (the documents end to end) and `name`.idx (their offsets),
    each through a temporary file renamed when complete; returns its manifest entry."""
    offsets = np.zeros(len(docs) + 1, np.uint64)
    offsets[1:] = np.cumsum([len(d) for d in docs])
    entry = {"documents": len(docs), "tokens": int(offsets[-1])}
    for key, suffix, array in (("file", ".bin", None), ("index", ".idx", offsets)):
        path = os.path.join(folder, name + suffix)
        with outputs.replacing(path) as f:
            if array is None:
                for d in docs:
                    np.asarray(d, dtype=dtype).tofile(f)
            else:
                array.tofile(f)
        entry.update({key: name + suffix, f"{key}_bytes": os.path.getsize(path),
                      f"{key}_sha256": sha256(path)})
    return entry


def write_manifest(folder: str, shards: list[dict], **fields) -> dict:
    """Writes the manifest (sealed: `seal`) whole or not at all; returns it."""
    manifest = {"format": FORMAT, **fields, "documents": sum(s["documents"] for s in shards),
                "tokens": sum(s["tokens"] for s in shards), "shards": shards}
    manifest["seal"] = seal(manifest)
    outputs.write_json(os.path.join(folder, MANIFEST), manifest, indent=1)
    return manifest


# --- Reading ------------------------------------------------------------------------------

def read_window(shards: list[Shard], start: int, n: int, checked: set | None = None) -> np.ndarray:
    """Tokens [start, start + n) of the stream, across shard boundaries; each shard
    read is checked first (`Shard.check`) unless its index is in `checked` (a batch's
    reads share one check per shard: a stat is 2 us, 256 of them a fifth of a batch)."""
    starts = np.array([s.start for s in shards])
    out, pos = [], start
    i = int(np.searchsorted(starts, start, side="right")) - 1
    while pos < start + n:
        shard = shards[i]
        if shard.path and (checked is None or i not in checked):
            shard.check()
            if checked is not None:
                checked.add(i)
        lo = pos - shard.start
        piece = np.asarray(shard.tokens[lo:lo + (start + n - pos)])
        out.append(piece)
        pos += len(piece)
        i += 1
    return np.concatenate(out)


def permute(index: np.ndarray, n: int, key: tuple[int, ...]) -> np.ndarray:
    """A pseudo-random permutation of [0, n) applied to `index` (module docstring):
    a balanced Feistel network over 2k bits (2^2k >= n), cycle-walking until the value
    falls inside [0, n), which keeps it a bijection of [0, n)."""
    bits = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << bits) - 1)
    keys = np.random.default_rng(list(key)).integers(0, 2**32, ROUNDS, dtype=np.uint64)
    x = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(x.shape, bool)
    while todo.any():
        left, right = x[todo] >> np.uint64(bits), x[todo] & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        x[todo] = (left << np.uint64(bits)) | right
        todo &= x >= np.uint64(n)
    return x.astype(np.int64)


def _mix(v: np.ndarray, key: np.uint64) -> np.ndarray:
    """A round function: splitmix64's finaliser of v + key (wrapping uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        z = v + key + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
