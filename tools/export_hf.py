"""Export a checkpoint as a Hugging Face folder of its model family (model.family: Llama,
Qwen2, Qwen3 or Mistral) that transformers loads:

    python tools/export_hf.py <run folder | checkpoint folder | step folder> <out folder>
        [--step N] [--dtype float32|bfloat16] [--max-shard-size 5GB]

Writes config.json (LlamaForCausalLM, Qwen2ForCausalLM, ...), generation_config.json
(the token ids), the weights as safetensors (one model.safetensors, or
model-0000i-of-0000n.safetensors + model.safetensors.index.json past
--max-shard-size) and, when the run's tokenizer is known, its tokenizer.json
(byte-level runs have none: their vocabulary is the 256 byte values). The checkpoint
may come from any layout (checkpoints are layout-independent); only its parameters are
read, onto one CPU device. Default dtype: that of the folder the run was initialised
from (train.init_from), else float32 (the parameters as trained). A Hugging Face
folder is accepted too (a re-export). Then, in Python:

    transformers.AutoModelForCausalLM.from_pretrained("<out folder>")
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.runtime.quiet import import_jax  # noqa: E402

import_jax()  # before anything imports JAX: its plugins' start-up lines stay off stderr

from framework.errors import ConfigError

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?I?B?)\s*", text.upper())
    if not match or match.group(2) not in UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size {text!r} is not a size such as 5GB, 500MB or 2000000")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def export(source_path: str, out: str, step: int | None = None, dtype: str | None = None,
           max_shard_size: str = "5GB") -> list[str]:
    """Returns the files written into `out`."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from framework.io import weights as artifacts
    from framework.io.hf import llama as hf
    from framework.io.tokenizer import BYTES

    max_bytes = parse_size(max_shard_size)
    source = artifacts.open_source(source_path, step, setting="source")
    original = source.hf_config or {}
    if dtype is None:
        stored = original.get("torch_dtype", original.get("dtype"))
        dtype = stored if stored in hf.EXPORT_DTYPES else "float32"
    if os.path.abspath(out) == os.path.abspath(source.path):
        raise ConfigError(f"the output folder {out} is the source: choose another")
    mesh = jax.make_mesh((1,), ("one",), devices=jax.devices("cpu")[:1])
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), hf.canonical_shapes(source.model))
    params = source.load(shardings)
    max_positions = (original.get("max_position_embeddings") or source.metadata.get("seq_len")
                     or 2048)
    tokenizer = source.tokenizer if source.tokenizer not in (None, BYTES) else None
    return hf.export(out, source.model, params, dtype, original, max_positions, max_bytes,
                     tokenizer)


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on read-only folders
    from framework.runtime import faults

    faults.LibraryOutput(os.devnull).install()  # an abandoned restore's thread noise
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="run folder, checkpoint folder or step folder")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"))
    parser.add_argument("--max-shard-size", default="5GB")
    args = parser.parse_args(argv)
    try:
        files = export(args.source, args.out, args.step, args.dtype, args.max_shard_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in files)
    print(f"wrote {', '.join(files)} ({size / 1e6:.1f} MB) to {args.out}: "
          f"AutoModelForCausalLM.from_pretrained({args.out!r}) loads it", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
