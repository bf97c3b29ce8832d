"""Text <-> token ids for generation: byte-level (UTF-8 bytes are the ids, vocabulary
256, what `data.kind=text` trains on) or a local Hugging Face `tokenizer.json` read by
the optional `tokenizers` package (nothing is downloaded)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Callable

from framework.errors import ConfigError
from framework.io import outputs

BYTES = "bytes"  # how metadata and sidecars name the byte-level codec


@dataclass(frozen=True)
class Codec:
    name: str  # "bytes" or the tokenizer.json path
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def byte_codec(vocab_size: int) -> Codec:
    def encode(text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        if ids and max(ids) >= vocab_size:
            raise ConfigError(f"the prompt has byte {max(ids)} but the model's vocabulary is "
                              f"{vocab_size}: use prompt_ids=... or ASCII below {vocab_size}")
        return ids

    return Codec(BYTES, encode, lambda ids: bytes(int(i) % 256 for i in ids)
                 .decode("utf-8", errors="replace"))


def read_hf(path: str, setting: str = "tokenizer"):
    """The `tokenizers` Tokenizer of a local tokenizer.json; ConfigError (one line,
    naming `setting`) when the package is missing or the file is not one."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"{setting} {path} needs the optional 'tokenizers' package: "
                          f"pip install -e '.[tokenizers]'") from None
    if not os.path.isfile(path):
        raise ConfigError(f"{setting} {path}: no such file (a local tokenizer.json)")
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # the Rust library raises its own exception type
        reason = " ".join(str(err).split())[:200]
        raise ConfigError(f"{setting} {path} is not a readable tokenizer.json "
                          f"({reason})") from None


def fingerprint(spec: str | None) -> str | None:
    """What a tokenizer is, for comparing two: "bytes", the SHA-256 of a tokenizer.json's
    bytes, or None (unknown)."""
    if spec is None or spec == BYTES:
        return spec
    digest = hashlib.sha256()
    try:
        with open(spec, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def hf_codec(path: str) -> Codec:
    """A tokenizer.json. encode adds the special tokens its post-processor defines
    (Llama 3's <|begin_of_text|>), as transformers does; decode drops special tokens."""
    tok = read_hf(path)
    return Codec(path, lambda text: tok.encode(text).ids,
                 lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=True))


def load(spec: str | None, vocab_size: int) -> Codec | None:
    """spec: "bytes", a tokenizer.json path, or None (unknown: ids only)."""
    if spec is None:
        return None
    return byte_codec(vocab_size) if spec == BYTES else hf_codec(spec)


def of_token_file(path: str) -> str | None:
    """What tools/prepare_data.py recorded for a token file (its sidecar `<path>.json`):
    "bytes", the tokenizer.json path (relative names are beside the sidecar), or None."""
    try:
        with open(path + ".json") as f:
            recorded = json.load(f).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        return None
    if not recorded or recorded == BYTES:
        return recorded or None
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), recorded)
    return beside if os.path.isfile(beside) else recorded if os.path.isfile(recorded) else None


def of_corpus(folder: str) -> str | None:
    """What a prepared corpus folder's manifest records (framework/io/corpus.py):
    "bytes", its tokenizer.json copy's path, or None."""
    try:
        with open(os.path.join(folder, "manifest.json")) as f:
            recorded = json.load(f).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        return None
    beside = os.path.join(folder, recorded) if recorded and recorded != BYTES else None
    return recorded if recorded == BYTES else beside if beside and os.path.isfile(beside) else None


def for_run(data_kind: str, data_path: str | None, vocab_size: int,
            init_from: str | None, mixture=None) -> str | None:
    """The tokenizer a training run's ids mean: the token file's or corpus's (tokens,
    corpus: the first of a mixture's), bytes (text; markov/synthetic with a vocabulary
    of at most 256), else the init_from folder's tokenizer.json (tokens without a
    sidecar), else None."""
    folder = mixture[0].get("path") if mixture and isinstance(mixture[0], dict) else data_path
    if data_kind in ("tokens", "corpus") and folder and os.path.isdir(os.path.expanduser(folder)):
        return of_corpus(os.path.expanduser(folder))
    if data_kind != "tokens":
        return BYTES if data_kind == "text" or vocab_size <= 256 else None
    recorded = of_token_file(os.path.expanduser(data_path)) if data_path else None
    if recorded:
        return recorded
    folder_tokenizer = os.path.join(init_from, "tokenizer.json") if init_from else None
    return folder_tokenizer if folder_tokenizer and os.path.isfile(folder_tokenizer) else None


def keep_in(spec: str | None, run_dir: str, write: bool) -> str | None:
    """A tokenizer.json is copied into the run folder (it travels with the checkpoints);
    returns what checkpoints record: "bytes", the copy's path, or None."""
    if spec is None or spec == BYTES:
        return spec
    copy = os.path.join(os.path.abspath(run_dir), "tokenizer.json")
    if write and os.path.abspath(spec) != copy:
        try:
            outputs.copy_file(spec, copy)
        except OSError as err:
            raise ConfigError(f"cannot copy the tokenizer {spec} into {run_dir}: "
                              f"{err.strerror or err}") from None
    return copy
