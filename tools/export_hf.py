"""Export a checkpoint as a Hugging Face folder of its model family (model.family: Llama,
Qwen2, Qwen3, Mistral, Gemma 2, or the mixtures of experts Qwen3-MoE, Mixtral and
Qwen2-MoE) that transformers loads:

    python tools/export_hf.py <run folder | checkpoint folder | step folder> <out folder>
        [--step N] [--dtype float32|bfloat16] [--max-shard-size 5GB] [--overwrite]

Writes config.json (LlamaForCausalLM, Qwen2ForCausalLM, ...), generation_config.json
(the token ids), the weights as safetensors (one model.safetensors, or
model-0000i-of-0000n.safetensors + model.safetensors.index.json past
--max-shard-size) and, when the run's tokenizer is known, its tokenizer.json
(byte-level runs have none: their vocabulary is the 256 byte values). The checkpoint
may come from any layout (checkpoints are layout-independent); only its parameters are
read, onto one CPU device. Default dtype: that of the folder the run was initialised
from (train.init_from), else that of the parameters as trained (optim.param_dtype). A Hugging Face
folder is accepted too (a re-export).

The output folder is new, empty, or a previous export (its export_hf.json lists its
files), which is replaced whole; any other folder with files is refused unless
--overwrite is given, and a folder holding checkpoints always is
(framework/io/hf/export_folder.py). Then, in Python:

    transformers.AutoModelForCausalLM.from_pretrained("<out folder>")
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.runtime.quiet import start_cpu_only  # noqa: E402

start_cpu_only()  # it reads onto the CPU only; the plugins' start-up lines stay off stderr

from framework.errors import ConfigError  # noqa: E402
from tools import entry  # noqa: E402

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?I?B?)\s*", text.upper())
    if not match or match.group(2) not in UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size {text!r} is not a size such as 5GB, 500MB or 2000000")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def export(source_path: str, out: str, step: int | None = None, dtype: str | None = None,
           max_shard_size: str = "5GB", overwrite: bool = False) -> list[str]:
    """Returns the files written into `out`. The folder is checked before anything is
    loaded; what it held goes only once the new export is complete."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from framework.io import weights as artifacts
    from framework.io.hf import export_folder, llama as hf
    from framework.io.tokenizer import BYTES

    max_bytes = parse_size(max_shard_size)
    source = artifacts.open_source(source_path, step, setting="source")
    dest = export_folder.check_destination(out, source.path, overwrite)
    original = source.hf_config or {}
    mesh = jax.make_mesh((1,), ("one",), devices=jax.devices("cpu")[:1])
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), hf.canonical_shapes(source.model))
    params = source.load(shardings)  # after the step fallback, source.step is the one read
    if dtype is None:
        stored = original.get("torch_dtype", original.get("dtype"))
        dtype = stored if stored in hf.EXPORT_DTYPES else source.stored_dtype
    tokenizer = source.tokenizer if source.tokenizer not in (None, BYTES) else None
    write = lambda folder: hf.export(folder, source.model, params, dtype, original,
                                     source.positions()[0], max_bytes, tokenizer)
    return export_folder.write(dest, write, {"source": source.path, "step": source.step,
                                             "dtype": dtype})


def parser() -> entry.Parser:
    p = entry.Parser(prog="tools/export_hf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="run folder, checkpoint folder or step folder")
    p.add_argument("out", help="the Hugging Face folder to write")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"))
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty folder of files that is not a previous "
                        "export (a previous export is replaced without it)")
    return p


def build(argv: list[str] | None = None) -> list[str]:
    """The command line's work, raising its errors; returns the files written."""
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on read-only folders
    from framework.runtime import faults

    faults.LibraryOutput(os.devnull).install()  # an abandoned restore's thread noise
    args = parser().parse_args(argv)
    from framework.io.hf.export_folder import entries

    try:
        before = entries(args.out) if os.path.isdir(args.out) else []
    except OSError:  # unreadable: export() says so in one line
        before = []
    files = export(args.source, args.out, args.step, args.dtype, args.max_shard_size,
                   args.overwrite)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in files)
    gone = sorted(set(before) - set(files))
    replaced = (f", replacing the {len(before)} files it held"
                + (f" ({len(gone)} not rewritten, now gone)" if gone else "")) if before else ""
    print(f"wrote {', '.join(files)} ({size / 1e6:.1f} MB) to {args.out}{replaced}: "
          f"AutoModelForCausalLM.from_pretrained({args.out!r}) loads it", file=sys.stderr)
    return files


def main(argv: list[str] | None = None) -> int:
    """The command line: `build`, every failure one line (tools/entry.py)."""
    return entry.run(build, argv)


if __name__ == "__main__":
    sys.exit(main())
