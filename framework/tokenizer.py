"""Text <-> token ids for generation: byte-level (UTF-8 bytes are the ids, vocabulary
256, what `data.kind=text` trains on) or a local Hugging Face `tokenizer.json` read by
the optional `tokenizers` package (nothing is downloaded)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from framework.config import ConfigError

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


def hf_codec(path: str) -> Codec:
    """A tokenizer.json. encode adds the special tokens its post-processor defines
    (Llama 3's <|begin_of_text|>), as transformers does; decode drops special tokens."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"{path} needs the optional 'tokenizers' package: "
                          f"pip install -e '.[tokenizers]'") from None
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer {path} does not exist")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as err:  # the Rust library raises its own exception type
        raise ConfigError(f"{path} is not a readable tokenizer.json ({err})") from None
    return Codec(path, lambda text: tok.encode(text).ids,
                 lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=True))


def load(spec: str | None, vocab_size: int) -> Codec | None:
    """spec: "bytes", a tokenizer.json path, or None (unknown: ids only)."""
    if spec is None:
        return None
    return byte_codec(vocab_size) if spec == BYTES else hf_codec(spec)
