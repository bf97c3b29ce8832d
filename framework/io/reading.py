"""Reading the tools' inputs as documents (tools/prepare_data.py, tools/train_tokenizer.py):
a .txt file is one document, .jsonl one per line (its `text_field`), .parquet one per
row of that column (pyarrow). Every problem with an input is one line (ConfigError)
naming the file, and the line where there is one: an unreadable file, text that is
not UTF-8, a line that is not a JSON object with a string `text_field`, a Parquet file
pyarrow cannot read. `identity` is what a prepared output records of each input.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

from framework.errors import ConfigError


def identity(path: str) -> dict:
    """What an output records of an input: its absolute path, size and modification
    time (ns); any change to the file changes one of them."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def documents(path: str, text_field: str) -> Iterator[str]:
    """The documents of one input, as strings (module docstring)."""
    try:
        if path.endswith(".jsonl"):
            yield from _json_lines(path, text_field)
        elif path.endswith(".parquet"):
            yield from _parquet(path, text_field)
        else:
            yield whole_text(path)
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}): "
                          f"convert it to UTF-8, or leave it out") from None
    except OSError as err:
        raise ConfigError(f"cannot read the input {path}: {err.strerror or err}") from None


def whole_text(path: str) -> str:
    """A file's text, whole; one line (ConfigError) when it is unreadable or not UTF-8."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}): "
                          f"convert it to UTF-8, or leave it out") from None
    except OSError as err:
        raise ConfigError(f"cannot read the input {path}: {err.strerror or err}") from None


def _json_lines(path: str, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise ConfigError(f"{path}:{n}: not a JSON object (one per line)") from None
            if not isinstance(record, dict) or text_field not in record:
                raise ConfigError(f"{path}:{n}: no {text_field!r} field (--text-field names "
                                  f"the field that holds the text)")
            yield _text(record[text_field], f"{path}:{n}", text_field)


def _parquet(path: str, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        row = 0
        for batch in pq.ParquetFile(path).iter_batches(columns=[text_field]):
            for value in batch.column(0).to_pylist():
                row += 1
                yield _text(value, f"{path}: row {row}", text_field)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:  # pyarrow's
        reason = " ".join(str(err).split())[:200]
        raise ConfigError(f"{path} is not a Parquet file with a {text_field!r} column of "
                          f"text ({reason}); --text-field names the column") from None


def _text(value, where: str, text_field: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: the {text_field!r} field is {type(value).__name__}, "
                          f"not text")
    return value
