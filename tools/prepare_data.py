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
restart skips the inputs whose shards are complete and were made from the same input
(path, size, modification time) with the same settings (a `.done` record beside them);
the others are prepared again. Progress and tokens per second go to stdout, errors
(one line) to stderr.

A flat file (OUT.bin):

Byte-level: the files' raw bytes, in the order given, `--separator` between files; the
result is what `data.kind=text` reads from the same single file. With `--tokenizer`, a
local Hugging Face `tokenizer.json` (the optional `tokenizers` package:
`pip install -e .[tokenizers]`; nothing is downloaded) encodes each file, and
`--eos-id` (if given) follows each file. Beside OUT a sidecar OUT.json records dtype,
vocab_size, n_tokens, the file's size and SHA-256, each input's identity and the
tokenizer ("bytes", or OUT.tokenizer.json: a copy of the tokenizer, which a training
run copies into its folder so that `framework.generate` and `tools/export_hf.py`
decode and ship the same one); `data.kind=tokens` checks the dtype, the size and (with
data.verify=checksum) the SHA-256 against it. Then train with: data.kind=tokens
data.path=OUT.bin data.token_dtype=<dtype printed>.

Outputs are written whole or not at all (framework/io/outputs.py): never into an input,
never into another tool's folder (a run, a Hugging Face folder), and into a folder or
over a file this tool did not write only with --overwrite. Every error is one line
`error: ...` (exit 2 for bad input; tools/entry.py lists the others).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

from framework.errors import ConfigError  # noqa: E402
from framework.io import outputs  # noqa: E402
from framework.io.reading import identity, whole_text  # noqa: E402
from framework.io.tokenizer import fingerprint, read_hf  # noqa: E402
from tools import entry  # noqa: E402

CHUNK_BYTES = 1 << 24  # byte-level files are converted 16 MiB at a time


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def byte_chunks(path: str) -> Iterator[np.ndarray]:
    try:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                yield np.frombuffer(chunk, dtype=np.uint8)
    except OSError as err:
        raise ConfigError(f"cannot read the input {path}: {err.strerror or err}") from None


def load_tokenizer(path: str) -> tuple[Callable[[str], list[int]], int]:
    """(encode, vocab_size) of a local tokenizer.json."""
    tok = read_hf(path, "--tokenizer")
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.get_vocab_size()


def file_tokens(path: str, encode: Callable[[str], list[int]] | None) -> Iterator[np.ndarray]:
    if encode is None:
        yield from byte_chunks(path)
        return
    yield np.asarray(encode(whole_text(path)), dtype=np.int64)  # every input as text


def write_tokens(out, inputs: list[str], dtype: str, separator: np.ndarray,
                 encode: Callable[[str], list[int]] | None, after_last: bool) -> tuple[int, str]:
    """Writes every input's tokens, `separator` after each input (but the last unless
    `after_last`); returns (the number of tokens written, their bytes' SHA-256)."""
    n, digest = 0, hashlib.sha256()
    for i, path in enumerate(inputs):
        last = [separator] if separator.size and (after_last or i < len(inputs) - 1) else []
        for ids in itertools.chain(file_tokens(path, encode), last):
            raw = ids.astype(dtype).tobytes()
            out.write(raw)
            digest.update(raw)
            n += ids.size
    return n, digest.hexdigest()


def _is_token_file(path: Path) -> bool:
    """Whether `path` is a token file this tool wrote (it has its sidecar)."""
    return Path(f"{path}.json").is_file()


def check_output(output: str, inputs: list[str], tokenizer: str | None,
                 overwrite: bool) -> None:
    """Before anything is written: the inputs exist, none is an output (the .bin, its
    sidecar or tokenizer copy), and OUT is new, this tool's, or --overwrite is given."""
    for path in inputs:
        if not os.path.isfile(path):
            raise ConfigError(f"input {path}: no such file")
    named = [("input", p) for p in inputs] + ([("--tokenizer", tokenizer)] if tokenizer else [])
    for target in (output, output + ".json", output + ".tokenizer.json"):
        outputs.refuse_inputs(target, named, folder=False)
    outputs.check_file(output, "a token file of tools/prepare_data.py (with its sidecar "
                       f"{os.path.basename(output)}.json)", overwrite, _is_token_file)


def prepare(output: str, inputs: list[str], tokenizer: str | None = None,
            separator: str = "\n", eos_id: int | None = None, overwrite: bool = False) -> dict:
    """Builds `output` and its sidecar `output.json`; returns the sidecar's content."""
    check_output(output, inputs, tokenizer, overwrite)
    if tokenizer is None and eos_id is not None:  # byte-level documents ending in it
        if not 0 <= eos_id < 256:
            raise ConfigError(f"--eos-id {eos_id} is not a byte (byte-level: 0..255)")
        encode, vocab_size = None, 256
        sep = np.asarray([eos_id], dtype=np.uint8)
    elif tokenizer is None:
        encode, vocab_size = None, 256
        sep = np.frombuffer(separator.encode("utf-8"), dtype=np.uint8)
    else:
        encode, vocab_size = load_tokenizer(tokenizer)
        sep = np.asarray([] if eos_id is None else [eos_id], dtype=np.int64)
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise ConfigError(f"--eos-id {eos_id} is outside the tokenizer's vocabulary "
                              f"of {vocab_size} (ids 0..{vocab_size - 1})")
    dtype = dtype_for(vocab_size)
    with outputs.replacing(output) as out:  # the old file stays until this is whole
        n_tokens, digest = write_tokens(out, inputs, dtype, sep, encode,
                                        after_last=tokenizer is not None or eos_id is not None)
        if n_tokens == 0:
            raise ConfigError(f"the inputs hold no text ({len(inputs)} files, 0 tokens): "
                              f"nothing to write")
    meta = {"dtype": dtype, "vocab_size": vocab_size, "n_tokens": n_tokens,
            "bytes": n_tokens * np.dtype(dtype).itemsize, "sha256": digest,
            "tokenizer": "bytes", "eos_id": eos_id,  # data.document_mask masks by it
            "inputs": [identity(p) for p in inputs]}
    if tokenizer is not None:  # a copy beside the data: training and generation find it
        copy = output + ".tokenizer.json"
        outputs.copy_file(tokenizer, copy)
        meta.update(tokenizer=os.path.basename(copy), tokenizer_source=os.path.abspath(tokenizer),
                    tokenizer_sha256=fingerprint(copy))
    outputs.write_json(output + ".json", meta)
    return meta


def parser() -> entry.Parser:
    p = entry.Parser(prog="tools/prepare_data.py", description=__doc__.split("\n\n")[0])
    p.add_argument("output", help="a folder of shards to write (e.g. data/corpus/), or "
                                  "a flat token file ending in .bin")
    p.add_argument("inputs", nargs="+", help="text, JSON lines or Parquet files "
                                             "(a .bin output: text files, concatenated)")
    p.add_argument("--tokenizer", help="a local tokenizer.json (default: byte-level)")
    p.add_argument("--separator", default="\n",
                   help="byte-level: text put between files (default: a newline)")
    p.add_argument("--eos-id", type=int,
                   help="with --tokenizer: id put after each document (a .bin output: "
                        "after each file)")
    p.add_argument("--processes", type=entry.positive_int("--processes"),
                   default=os.cpu_count() or 1, help="tokenizing worker processes (a folder "
                                                      "of shards)")
    p.add_argument("--shard-tokens", type=entry.positive_int("--shard-tokens"),
                   default=100_000_000)
    p.add_argument("--text-field", default="text", help="JSON lines, Parquet: the column")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a folder (or over a file) with files this tool did not "
                        "write; never into a run folder or a Hugging Face folder")
    return p


def build(argv: list[str] | None = None) -> dict:
    """The command line's work, raising its errors: the manifest or the sidecar."""
    args = parser().parse_args(argv)
    if not args.output.endswith(".bin"):  # a folder of shards
        from framework.io.prepare import Settings, prepare_shards

        settings = Settings(args.tokenizer, args.eos_id, args.shard_tokens, args.text_field)
        return prepare_shards(args.output, args.inputs, settings, args.processes,
                              args.overwrite)
    meta = prepare(args.output, args.inputs, args.tokenizer, args.separator, args.eos_id,
                   args.overwrite)
    print(f"wrote {meta['n_tokens']} {meta['dtype']} tokens (vocab {meta['vocab_size']}) "
          f"to {args.output}: use data.kind=tokens data.path={args.output} "
          f"data.token_dtype={meta['dtype']}")
    return meta


def main(argv: list[str] | None = None) -> int:
    """The command line: `build`, every failure one line (tools/entry.py)."""
    return entry.run(build, argv)


if __name__ == "__main__":
    sys.exit(main())
