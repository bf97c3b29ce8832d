"""Train a byte-level BPE tokenizer on your own text, locally (the `tokenizers` library;
nothing is downloaded), for tools/prepare_data.py --tokenizer.

    python tools/train_tokenizer.py tokenizer.json notes/*.txt --vocab-size 4096

Inputs are read as tools/prepare_data.py reads them (.txt whole, .jsonl by
`--text-field`, framework/io/reading.py). The end-of-document token `<|endoftext|>` is
id 0: pass `--eos-id 0` to tools/prepare_data.py, and data.document_mask=true masks by
it. Byte-level BPE (Radford et al. 2019, GPT-2): every byte is in the vocabulary, so
any text encodes and decodes back exactly.

The output is written whole or not at all (framework/io/outputs.py); it is never an
input, and an existing file that is not a tokenizer.json is replaced only with
--overwrite. Every error is one line `error: ...` (exit 2 for bad input; tools/entry.py
lists the others).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

from framework.errors import ConfigError  # noqa: E402
from framework.io import outputs  # noqa: E402
from framework.io.reading import documents  # noqa: E402
from tools import entry  # noqa: E402

EOS = "<|endoftext|>"


def texts(paths: list[str], text_field: str):
    """The documents of the inputs, one string at a time."""
    for path in paths:
        yield from documents(path, text_field)


def is_tokenizer(path: Path) -> bool:
    """Whether `path` holds a tokenizer.json (what this tool writes): a JSON object with
    a `model`. Read only up to a size a tokenizer could have."""
    try:
        if path.stat().st_size > 1 << 30:
            return False
        return isinstance(json.loads(path.read_text(encoding="utf-8")).get("model"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def train(out: str, paths: list[str], vocab_size: int, text_field: str = "text") -> int:
    """Writes the tokenizer to `out` (whole or not at all); returns its vocabulary size."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ConfigError("tools/train_tokenizer.py needs the optional 'tokenizers' package: "
                          "pip install -e '.[tokenizers]'") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts(paths, text_field), trainer=trainer)
    with outputs.replacing(out, "w") as f:
        f.write(tok.to_str())
    return tok.get_vocab_size()


def parser() -> entry.Parser:
    p = entry.Parser(prog="tools/train_tokenizer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("output", help="the tokenizer.json to write")
    p.add_argument("inputs", nargs="+", help=".txt or .jsonl files")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--text-field", default="text", help=".jsonl: the text's field")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing file that is not a tokenizer.json")
    return p


def build(argv=None) -> int:
    """The command line's work, raising its errors; returns the vocabulary size."""
    args = parser().parse_args(argv)
    missing = [p for p in args.inputs if not os.path.isfile(p)]
    if missing:
        raise ConfigError(f"input {missing[0]}: no such file")
    if not 257 <= args.vocab_size <= 1 << 20:
        raise ConfigError(f"--vocab-size {args.vocab_size} must be in [257, 1048576] (256 "
                          f"bytes and the end-of-document token at least)")
    outputs.refuse_inputs(args.output, [("input", p) for p in args.inputs], folder=False)
    outputs.check_file(args.output, "a tokenizer.json", args.overwrite, is_tokenizer)
    size = train(args.output, args.inputs, args.vocab_size, args.text_field)
    print(f"wrote {args.output}: byte-level BPE, vocabulary {size}, {EOS} = id 0 "
          f"(tools/prepare_data.py --eos-id 0; model.vocab_size >= {size})")
    return size


def main(argv=None) -> int:
    """The command line: `build`, every failure one line (tools/entry.py)."""
    return entry.run(build, argv)


if __name__ == "__main__":
    sys.exit(main())
