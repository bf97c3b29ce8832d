"""How fast a corpus feeds training: tokens per second one process reads and packs.

    python tools/bench_loader.py corpus/ --seq-len 2048 --batch 256 --steps 50

Reads the training batches of steps 0..steps-1 of `data.kind=corpus` (framework/io/
corpus.py: permuted sequences from memory-mapped shards) as a run's loader does, and
prints tokens per second and milliseconds per batch, beside what a step of that shape
consumes at a given step time (`--step-time`, seconds: the loader keeps up while its
time per batch is below it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root


def main(argv=None) -> int:
    from framework.config import DataConfig, TrainConfig
    from framework.errors import ConfigError
    from framework.io import data

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus", help="a folder of shards from tools/prepare_data.py")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--vocab-size", type=int, default=2**32)
    parser.add_argument("--step-time", type=float, default=None)
    args = parser.parse_args(argv)
    cfg = DataConfig(kind="corpus", path=args.corpus, holdout_fraction=0.0)
    try:
        ds = data.make_dataset(cfg, TrainConfig(seq_len=args.seq_len,
                                                global_batch_size=args.batch), args.vocab_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    tokens = sum(ds.train_batch(step).size for step in range(args.steps))
    seconds = time.perf_counter() - start
    per_batch = seconds / args.steps
    print(f"{tokens / seconds:,.0f} tokens/s; {per_batch * 1e3:.2f} ms per batch of "
          f"{args.batch} x {args.seq_len + 1}")
    if args.step_time:
        consumed = args.batch * args.seq_len / args.step_time
        print(f"a step of {args.step_time} s consumes {consumed:,.0f} tokens/s: the loader "
              f"needs {per_batch / args.step_time:.1%} of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
