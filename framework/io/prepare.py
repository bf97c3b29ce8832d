"""Preparing a sharded corpus (`tools/prepare_data.py <folder>`; the format is
framework/io/corpus.py's): inputs read as documents, tokenized in parallel processes,
written as shards with a document index, then the manifest.

Work is split by input: each worker process takes one input file at a time, reads its
documents (a .txt file is one document; .jsonl one per line, the `text_field` of each;
.parquet one per row of that column, needs pyarrow), encodes them in batches of
BATCH with the `tokenizers` library (`encode_batch`, itself multi-threaded) or as raw
bytes, and writes shards `shard-<input>-<part>` of about `shard_tokens` tokens
(documents are never split), each written whole or not at all (framework/io/outputs.py).

What made each input's shards is recorded beside them (`input-<i>.done`): the input's
identity (its path, size and modification time) and the settings (the tokenizer's
SHA-256, vocabulary, dtype, eos_id, text field). A restart skips an input only when its
record matches the input and the settings as given now and its shards are intact
(sizes and SHA-256); any other input is prepared again. The manifest is removed before
the first shard changes and written last, in input order, so a corpus is usable only
once complete; shards no record lists any more are then removed.

Errors are one line (ConfigError): a worker's failure (bad JSON, a missing or
non-string field, text that is not UTF-8, an unreadable file) reaches the parent, which
stops the other workers; a worker that dies is a BrokenProcessPool. With one process
the inputs are prepared in this one.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import sys
import time
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from framework.errors import ConfigError
from framework.io import corpus, outputs
from framework.io.reading import documents, identity
from framework.io.tokenizer import fingerprint, read_hf

BATCH = 1000  # documents encoded per encode_batch call
_ENCODE = None  # the worker's encoder (set once per process by _start_worker)
OWN_FILES = re.compile(r"(shard-\d{5}-\d{3}\.(bin|idx)|input-\d{5}\.done|manifest\.json|"
                       r"tokenizer\.json)$")


@dataclass(frozen=True)
class Settings:
    """What the shards depend on besides the inputs (recorded in the done-markers)."""
    tokenizer: str | None = None  # a local tokenizer.json, or None: byte-level
    eos_id: int | None = None  # appended to every document
    shard_tokens: int = 100_000_000
    text_field: str = "text"


def prepare_shards(folder: str, inputs: list[str], settings: Settings = Settings(),
                   workers: int = 1, overwrite: bool = False, log=None) -> dict:
    """Writes the corpus into `folder` (module docstring); returns its manifest.
    Progress goes to `log` (default: stdout)."""
    log = log or sys.stdout
    recipe = _check(folder, inputs, settings, overwrite)
    os.makedirs(folder, exist_ok=True)
    outputs.sweep_partials(folder)
    records = {i: _reusable(folder, i, path, recipe) for i, path in enumerate(inputs)}
    todo = [i for i, why in records.items() if why is not None]
    for i in todo:
        if records[i]:
            print(f"{inputs[i]}: {records[i]}: preparing it again", file=log)
    if todo:
        Path(folder, corpus.MANIFEST).unlink(missing_ok=True)  # unusable until complete
    n = max(1, min(workers, len(todo)))
    print(f"{len(inputs)} inputs, {len(inputs) - len(todo)} already done; {n} processes",
          file=log)
    _run_workers(folder, inputs, todo, settings, recipe, n, log)
    shards = []
    for i in range(len(inputs)):
        with open(_done(folder, i)) as f:
            shards += json.load(f)["shards"]
    if not any(s["tokens"] for s in shards):
        raise ConfigError(f"the inputs hold no text ({len(inputs)} files, 0 tokens): "
                          f"give inputs with documents in them")
    fields = {**{k: v for k, v in recipe.items() if k != "tokenizer_sha256"},
              "tokenizer": "bytes", "inputs": [identity(p) for p in inputs]}
    if settings.tokenizer is not None:  # a copy beside the shards: training and generation
        outputs.copy_file(settings.tokenizer, os.path.join(folder, "tokenizer.json"))
        fields.update(tokenizer="tokenizer.json", tokenizer_sha256=recipe["tokenizer_sha256"])
    manifest = corpus.write_manifest(folder, shards, **fields)
    _remove_unlisted(folder, shards, len(inputs), keep_tokenizer=settings.tokenizer is not None)
    print(f"wrote {manifest['tokens']:,} {recipe['dtype']} tokens of "
          f"{manifest['documents']:,} documents in {len(shards)} shards to {folder}: use "
          f"data.kind=corpus data.path={folder}", file=log)
    return manifest


def _check(folder: str, inputs: list[str], settings: Settings, overwrite: bool) -> dict:
    """Everything checked before a file is written; returns the settings' record."""
    for path in inputs:
        if not os.path.isfile(path):
            raise ConfigError(f"input {path}: no such file")
        if path.endswith(".parquet"):
            _require_pyarrow()
    if settings.shard_tokens < 1:
        raise ConfigError(f"--shard-tokens {settings.shard_tokens} must be >= 1")
    named = [("input", p) for p in inputs]
    if settings.tokenizer is not None:
        named.append(("--tokenizer", settings.tokenizer))
    outputs.refuse_inputs(folder, named, folder=True)
    outputs.check_folder(folder, "corpus", overwrite)
    vocab_size = 256 if settings.tokenizer is None else \
        read_hf(settings.tokenizer, "--tokenizer").get_vocab_size()
    if settings.eos_id is not None and not 0 <= settings.eos_id < vocab_size:
        raise ConfigError(f"--eos-id {settings.eos_id} is outside the vocabulary of "
                          f"{vocab_size} (ids 0..{vocab_size - 1})")
    return {"tokenizer_sha256": fingerprint(settings.tokenizer or "bytes"),
            "vocab_size": vocab_size, "dtype": "uint16" if vocab_size <= 1 << 16 else "uint32",
            "eos_id": settings.eos_id, "text_field": settings.text_field}


def _done(folder: str, i: int) -> str:
    return os.path.join(folder, f"input-{i:05d}.done")


def _reusable(folder: str, i: int, path: str, recipe: dict) -> str | None:
    """None when input i's shards may be kept as they are; else why not ("" when it was
    never prepared)."""
    try:
        with open(_done(folder, i)) as f:
            record = json.load(f)
    except FileNotFoundError:
        return ""
    except (OSError, ValueError):
        return "its record is unreadable"
    if not isinstance(record, dict) or record.get("identity") != identity(path):
        return "the input is not the one prepared before (path, size or modification time)"
    if record.get("settings") != recipe:
        return "the tokenizer, --eos-id, vocabulary or --text-field changed"
    for entry in record.get("shards", []):
        for key in ("file", "index"):
            where = os.path.join(folder, entry[key])
            if not os.path.isfile(where) or os.path.getsize(where) != entry[f"{key}_bytes"] \
                    or corpus.sha256(where) != entry[f"{key}_sha256"]:
                return f"its shard {entry[key]} is missing or damaged"
    return None


def _require_pyarrow():
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError("Parquet inputs need pyarrow: pip install pyarrow") from None


def _run_workers(folder, inputs, todo, settings, recipe, n, log) -> None:
    """Prepares the inputs `todo` in `n` processes (one: in this one); the first failure
    stops them all, and leaves no partial file."""
    start, tokens, finished = time.perf_counter(), 0, 0

    def report(i: int, entries: list[dict]) -> None:
        nonlocal tokens, finished
        finished += 1
        tokens += sum(e["tokens"] for e in entries)
        rate = tokens / max(time.perf_counter() - start, 1e-9)
        print(f"[{finished}/{len(todo)}] {inputs[i]}: {len(entries)} shards, "
              f"{sum(e['documents'] for e in entries):,} documents; "
              f"{tokens:,} tokens at {rate:,.0f} tokens/s", file=log, flush=True)

    jobs = [(folder, i, inputs[i], settings, recipe) for i in todo]
    if n == 1:
        encode = _encoder(settings.tokenizer) if jobs else None
        try:
            for job in jobs:
                report(*_prepare_input(job, encode))
        except BaseException:
            outputs.sweep_partials(folder)
            raise
        return
    pool = ProcessPoolExecutor(n, multiprocessing.get_context("spawn"), _start_worker,
                               (settings.tokenizer, True))
    try:
        pending = {pool.submit(_prepare_input, job) for job in jobs}
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in done:
                report(*future.result())  # a worker's error is raised here
    except BaseException:
        _stop(pool)
        outputs.sweep_partials(folder)
        raise
    pool.shutdown()


def _stop(pool: ProcessPoolExecutor) -> None:
    """Stops the workers now (their current input is abandoned, its files removed)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(10)


def _remove_unlisted(folder: str, shards: list[dict], n_inputs: int, keep_tokenizer: bool):
    """Removes this tool's files that the manifest no longer lists (an input prepared
    again into fewer shards, inputs dropped, a tokenizer no longer used)."""
    listed = {s[k] for s in shards for k in ("file", "index")} | {corpus.MANIFEST}
    listed |= {os.path.basename(_done(folder, i)) for i in range(n_inputs)}
    if keep_tokenizer:
        listed.add("tokenizer.json")
    for name in os.listdir(folder):
        if OWN_FILES.fullmatch(name) and name not in listed:
            os.unlink(os.path.join(folder, name))


def _encoder(tokenizer: str | None):
    """texts -> their ids, one array each: the raw UTF-8 bytes, or the tokenizer's."""
    if tokenizer is None:
        return lambda texts: [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
    tok = read_hf(tokenizer, "--tokenizer")
    return lambda texts: [np.asarray(e.ids) for e in
                          tok.encode_batch(texts, add_special_tokens=False)]


def _start_worker(tokenizer: str | None, one_thread: bool) -> None:
    """The worker's encoder. With several workers each encodes on one thread: the
    `tokenizers` library's own threads (one per core in every process) oversubscribe
    the cores (measured: docs/data.md). Ctrl-C is the parent's to handle."""
    global _ENCODE
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if one_thread:
        os.environ["RAYON_NUM_THREADS"] = "1"  # read when tokenizers starts its pool
    try:
        _ENCODE = _encoder(tokenizer)
    except ConfigError as err:  # raised by the first job: an initializer's error hangs
        _ENCODE = err


def _prepare_input(job, encode=None) -> tuple[int, list[dict]]:
    """Input i's shards and its record (in a worker, or here with `encode`)."""
    folder, i, path, settings, recipe = job
    encode = encode or _ENCODE
    if isinstance(encode, ConfigError):
        raise encode
    eos = [] if settings.eos_id is None else [settings.eos_id]
    entries, pending, batch, size = [], [], [], [0]  # size[0]: tokens pending

    def flush_batch():
        for ids in encode(batch):
            pending.append(np.concatenate([ids, np.asarray(eos, ids.dtype)]) if eos else ids)
            size[0] += len(pending[-1])
            if size[0] >= settings.shard_tokens:
                close_shard()
        batch.clear()

    def close_shard():
        entries.append(corpus.write_shard(folder, corpus.shard_name(i, len(entries)),
                                          pending, recipe["dtype"]))
        pending.clear()
        size[0] = 0

    for text in documents(path, settings.text_field):
        batch.append(text)
        if len(batch) == BATCH:
            flush_batch()
    flush_batch()
    if pending:
        close_shard()
    outputs.write_json(_done(folder, i), {"input": os.path.abspath(path),
                                          "identity": identity(path), "settings": recipe,
                                          "shards": entries})
    return i, entries

