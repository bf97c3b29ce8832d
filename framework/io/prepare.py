"""Preparing a sharded corpus (`tools/prepare_data.py <folder>`; the format is
framework/io/corpus.py's): inputs read as documents, tokenized in parallel processes,
written as shards with a document index, then the manifest.

Work is split by input: each worker process takes one input file at a time, reads its
documents (a .txt file is one document; .jsonl one per line, the `text_field` of each;
.parquet one per row of that column, needs pyarrow), encodes them in batches of
BATCH with the `tokenizers` library (`encode_batch`, itself multi-threaded) or as raw
bytes, and writes shards `shard-<input>-<part>` of about `shard_tokens` tokens
(documents are never split). When an input's shards are written, a record
`<input>.done` lists them; a restart skips those inputs. The manifest is written last,
in input order, so a corpus is usable only once complete.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import time

import numpy as np

from framework.io import corpus

BATCH = 1000  # documents encoded per encode_batch call
_ENCODE = None  # the worker's encoder (set once per process by _start_worker)


def prepare_shards(folder: str, inputs: list[str], tokenizer: str | None = None,
                   eos_id: int | None = None, workers: int = 1,
                   shard_tokens: int = 100_000_000, text_field: str = "text",
                   log=sys.stderr) -> dict:
    """Writes the corpus into `folder` (module docstring); returns its manifest."""
    for path in inputs:
        if not os.path.isfile(path):
            raise SystemExit(f"{path}: no such file")
        if path.endswith(".parquet"):
            _require_pyarrow()
    vocab_size = _vocab_size(tokenizer)
    if eos_id is not None and not 0 <= eos_id < vocab_size:
        raise SystemExit(f"--eos-id {eos_id} is outside the vocabulary of {vocab_size}")
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    os.makedirs(folder, exist_ok=True)
    todo = [i for i in range(len(inputs)) if not os.path.isfile(_done(folder, i))]
    jobs = [(folder, i, inputs[i], dtype, eos_id, shard_tokens, text_field) for i in todo]
    start, tokens = time.perf_counter(), 0
    print(f"{len(inputs)} inputs, {len(inputs) - len(todo)} already done; "
          f"{min(workers, max(len(todo), 1))} processes", file=log)
    n = max(1, min(workers, len(todo) or 1))
    with multiprocessing.get_context("spawn").Pool(n, _start_worker, (tokenizer, n > 1)) as pool:
        for n, (i, entries) in enumerate(pool.imap_unordered(_prepare_input, jobs), 1):
            tokens += sum(e["tokens"] for e in entries)
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            print(f"[{n}/{len(todo)}] {inputs[i]}: {len(entries)} shards, "
                  f"{sum(e['documents'] for e in entries):,} documents; "
                  f"{tokens:,} tokens at {rate:,.0f} tokens/s", file=log, flush=True)
    shards = []
    for i in range(len(inputs)):
        with open(_done(folder, i)) as f:
            shards += json.load(f)["shards"]
    fields = {"tokenizer": "bytes", "vocab_size": vocab_size, "dtype": dtype,
              "eos_id": eos_id, "inputs": [os.path.abspath(p) for p in inputs]}
    if tokenizer is not None:  # a copy beside the shards: training and generation find it
        shutil.copyfile(tokenizer, os.path.join(folder, "tokenizer.json"))
        fields["tokenizer"] = "tokenizer.json"
    manifest = corpus.write_manifest(folder, shards, **fields)
    print(f"wrote {manifest['tokens']:,} {dtype} tokens of {manifest['documents']:,} "
          f"documents in {len(shards)} shards to {folder}: use data.kind=corpus "
          f"data.path={folder}", file=log)
    return manifest


def _done(folder: str, i: int) -> str:
    return os.path.join(folder, f"input-{i:05d}.done")


def _require_pyarrow():
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise SystemExit("Parquet inputs need pyarrow: pip install pyarrow") from None


def _vocab_size(tokenizer: str | None) -> int:
    if tokenizer is None:
        return 256
    if not os.path.isfile(tokenizer):
        raise SystemExit(f"--tokenizer {tokenizer}: no such file (a local tokenizer.json)")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer).get_vocab_size()


def _start_worker(tokenizer: str | None, one_thread: bool) -> None:
    """The worker's encoder. With several workers each encodes on one thread: the
    `tokenizers` library's own threads (one per core in every process) oversubscribe
    the cores (measured: docs/data.md)."""
    global _ENCODE
    if one_thread:
        os.environ["RAYON_NUM_THREADS"] = "1"  # read when tokenizers starts its pool
    if tokenizer is None:
        _ENCODE = lambda texts: [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
        return
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    _ENCODE = lambda texts: [np.asarray(e.ids) for e in
                             tok.encode_batch(texts, add_special_tokens=False)]


def documents(path: str, text_field: str):
    """The documents of one input, as strings (module docstring)."""
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)[text_field]
                    except (ValueError, KeyError, TypeError):
                        raise SystemExit(f"{path}:{n}: not a JSON object with a "
                                         f"{text_field!r} field (--text-field)") from None
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(columns=[text_field]):
            yield from batch.column(0).to_pylist()
    else:
        with open(path, encoding="utf-8") as f:
            yield f.read()


def _prepare_input(job) -> tuple[int, list[dict]]:
    folder, i, path, dtype, eos_id, shard_tokens, text_field = job
    eos = [] if eos_id is None else [eos_id]
    entries, pending, size, batch = [], [], 0, []

    def flush_batch():
        nonlocal size
        for ids in _ENCODE(batch):
            pending.append(np.concatenate([ids, np.asarray(eos, ids.dtype)]) if eos else ids)
            size += len(pending[-1])
            if size >= shard_tokens:
                close_shard()
        batch.clear()

    def close_shard():
        nonlocal size
        entries.append(corpus.write_shard(folder, corpus.shard_name(i, len(entries)),
                                          pending, dtype))
        pending.clear()
        size = 0

    for text in documents(path, text_field):
        batch.append(text)
        if len(batch) == BATCH:
            flush_batch()
    flush_batch()
    if pending:
        close_shard()
    with open(_done(folder, i) + ".tmp", "w") as f:
        json.dump({"input": path, "shards": entries}, f)
    os.replace(_done(folder, i) + ".tmp", _done(folder, i))
    return i, entries
