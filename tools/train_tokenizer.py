"""Train a byte-level BPE tokenizer on your own text, locally (the `tokenizers` library;
nothing is downloaded), for tools/prepare_data.py --tokenizer.

    python tools/train_tokenizer.py tokenizer.json notes/*.txt --vocab-size 4096

Inputs are read as tools/prepare_data.py reads them (.txt whole, .jsonl by
`--text-field`). The end-of-document token `<|endoftext|>` is id 0: pass `--eos-id 0`
to tools/prepare_data.py, and data.document_mask=true masks by it. Byte-level BPE
(Radford et al. 2019, GPT-2): every byte is in the vocabulary, so any text encodes and
decodes back exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EOS = "<|endoftext|>"


def texts(paths: list[str], text_field: str):
    """The documents of the inputs, one string at a time."""
    for path in paths:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield str(json.loads(line)[text_field])
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()


def train(out: str, paths: list[str], vocab_size: int, text_field: str = "text") -> int:
    """Writes the tokenizer to `out`; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts(paths, text_field), trainer=trainer)
    tok.save(out)
    return tok.get_vocab_size()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the tokenizer.json to write")
    parser.add_argument("inputs", nargs="+", help=".txt or .jsonl files")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--text-field", default="text", help=".jsonl: the text's field")
    args = parser.parse_args(argv)
    missing = [p for p in args.inputs if not os.path.isfile(p)]
    if missing:
        print(f"error: no such file: {missing[0]}", file=sys.stderr)
        return 2
    if not 257 <= args.vocab_size <= 1 << 20:
        print(f"error: --vocab-size {args.vocab_size} must be in [257, 1048576] (256 bytes "
              f"and the end-of-document token at least)", file=sys.stderr)
        return 2
    if os.path.abspath(args.output) in {os.path.abspath(p) for p in args.inputs}:
        print(f"error: the output {args.output} is one of the inputs", file=sys.stderr)
        return 2
    size = train(args.output, args.inputs, args.vocab_size, args.text_field)
    print(f"wrote {args.output}: byte-level BPE, vocabulary {size}, {EOS} = id 0 "
          f"(tools/prepare_data.py --eos-id 0; model.vocab_size >= {size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
