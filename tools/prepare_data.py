"""Prepare training data: a folder of token shards (`data.kind=corpus`), or one flat
token file (`data.kind=tokens`, OUT ending in .bin).

    python tools/prepare_data.py corpus/ web/*.jsonl books/*.txt --tokenizer tok.json \
        --eos-id 2 --processes 8 --shard-tokens 100000000     # a folder of shards
    python tools/prepare_data.py OUT.bin a.txt b.txt                  # byte-level, vocab 256
    python tools/prepare_data.py OUT.bin corpus/*.txt --tokenizer tokenizer.json

A folder of shards (framework/io/prepare.py, the format framework/io/corpus.py): each
input is read as documents (a .txt file: one document; .jsonl: one per line, its
`--text-field`; .parquet: one per row of that column, with pyarrow), tokenized in
batches (`Tokenizer.encode_batch`) by `--processes` worker processes, one input at a
time each, and written as shards of about `--shard-tokens` tokens with a document
index, then a manifest with each shard's documents, tokens and SHA-256 checksums. A
restart skips the inputs whose shards are complete (a `.done` record beside them).
Progress and tokens per second go to stderr.

A flat file (OUT.bin):

Byte-level: the files' raw bytes, in the order given, `--separator` between files; the
result is what `data.kind=text` reads from the same single file. With `--tokenizer`, a
local Hugging Face `tokenizer.json` (the optional `tokenizers` package:
`pip install -e .[tokenizers]`; nothing is downloaded) encodes each file, and
`--eos-id` (if given) follows each file. Beside OUT a sidecar OUT.json records dtype,
vocab_size, n_tokens and the tokenizer ("bytes", or OUT.tokenizer.json: a copy of the
tokenizer, which a training run copies into its folder so that `framework.generate`
and `tools/export_hf.py` decode and ship the same one); `data.kind=tokens` checks the
dtype against it. Then train with: data.kind=tokens data.path=OUT.bin
data.token_dtype=<dtype printed>.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np

CHUNK_BYTES = 1 << 24  # byte-level files are converted 16 MiB at a time


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def byte_chunks(path: str) -> Iterator[np.ndarray]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield np.frombuffer(chunk, dtype=np.uint8)


def load_tokenizer(path: str) -> tuple[Callable[[str], list[int]], int]:
    """(encode, vocab_size) of a local tokenizer.json."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit("--tokenizer needs the optional 'tokenizers' package: "
                         "pip install -e .[tokenizers] (or: pip install tokenizers)") from None
    if not os.path.isfile(path):
        raise SystemExit(f"--tokenizer {path}: no such file (a local tokenizer.json)")
    tok = Tokenizer.from_file(path)
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.get_vocab_size()


def file_tokens(path: str, encode: Callable[[str], list[int]] | None) -> Iterator[np.ndarray]:
    if encode is None:
        yield from byte_chunks(path)
        return
    with open(path, encoding="utf-8") as f:
        yield np.asarray(encode(f.read()), dtype=np.int64)


def write_tokens(out: BinaryIO, inputs: list[str], dtype: str, separator: np.ndarray,
                 encode: Callable[[str], list[int]] | None, after_last: bool) -> int:
    """Writes every input's tokens, `separator` after each input (but the last unless
    `after_last`); returns the number of tokens written."""
    n = 0
    for i, path in enumerate(inputs):
        for ids in file_tokens(path, encode):
            ids.astype(dtype).tofile(out)
            n += ids.size
        if separator.size and (after_last or i < len(inputs) - 1):
            separator.astype(dtype).tofile(out)
            n += separator.size
    return n


def prepare(output: str, inputs: list[str], tokenizer: str | None = None,
            separator: str = "\n", eos_id: int | None = None) -> dict:
    """Builds `output` and its sidecar `output.json`; returns the sidecar's content."""
    for path in inputs:
        if not os.path.isfile(path):
            raise SystemExit(f"{path}: no such file")
    if tokenizer is None and eos_id is not None:  # byte-level documents ending in it
        if not 0 <= eos_id < 256:
            raise SystemExit(f"--eos-id {eos_id} is not a byte (byte-level: 0..255)")
        encode, vocab_size = None, 256
        sep = np.asarray([eos_id], dtype=np.uint8)
    elif tokenizer is None:
        encode, vocab_size = None, 256
        sep = np.frombuffer(separator.encode("utf-8"), dtype=np.uint8)
    else:
        encode, vocab_size = load_tokenizer(tokenizer)
        sep = np.asarray([] if eos_id is None else [eos_id], dtype=np.int64)
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise SystemExit(f"--eos-id {eos_id} is outside the tokenizer's vocabulary "
                             f"of {vocab_size}")
    dtype = dtype_for(vocab_size)
    with open(output, "wb") as out:
        n_tokens = write_tokens(out, inputs, dtype, sep, encode,
                                after_last=tokenizer is not None or eos_id is not None)
    meta = {"dtype": dtype, "vocab_size": vocab_size, "n_tokens": n_tokens,
            "tokenizer": "bytes", "eos_id": eos_id,  # data.document_mask masks by it
            "inputs": [os.path.abspath(p) for p in inputs]}
    if tokenizer is not None:  # a copy beside the data: training and generation find it
        copy = output + ".tokenizer.json"
        shutil.copyfile(tokenizer, copy)
        meta.update(tokenizer=os.path.basename(copy), tokenizer_source=os.path.abspath(tokenizer))
    with open(output + ".json", "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="a folder of shards to write (e.g. data/corpus/), or "
                                       "a flat token file ending in .bin")
    parser.add_argument("inputs", nargs="+", help="text, JSON lines or Parquet files "
                                                  "(a .bin output: text files, concatenated)")
    parser.add_argument("--tokenizer", help="a local tokenizer.json (default: byte-level)")
    parser.add_argument("--separator", default="\n",
                        help="byte-level: text put between files (default: a newline)")
    parser.add_argument("--eos-id", type=int,
                        help="with --tokenizer: id put after each document (a .bin output: "
                             "after each file)")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                        help="tokenizing worker processes (a folder of shards)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000)
    parser.add_argument("--text-field", default="text", help="JSON lines, Parquet: the column")
    args = parser.parse_args(argv)
    if not args.output.endswith(".bin"):  # a folder of shards
        if args.processes < 1:
            parser.error(f"--processes {args.processes} must be >= 1")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
        from framework.io.prepare import prepare_shards

        return prepare_shards(args.output, args.inputs, args.tokenizer, args.eos_id,
                              args.processes, args.shard_tokens, args.text_field)
    meta = prepare(args.output, args.inputs, args.tokenizer, args.separator, args.eos_id)
    print(f"wrote {meta['n_tokens']} {meta['dtype']} tokens (vocab {meta['vocab_size']}) "
          f"to {args.output}: use data.kind=tokens data.path={args.output} "
          f"data.token_dtype={meta['dtype']}", file=sys.stderr)
    return meta


if __name__ == "__main__":
    main()
