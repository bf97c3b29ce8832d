"""Per-device memory of each pipeline schedule as the microbatch count grows.

    python tools/schedule_memory.py --pipeline 4 --microbatches 4 8 16

Compiles the train step (it does not run it) for every schedule at a fixed microbatch
size, so the global batch grows with the microbatch count, and prints XLA's memory
analysis per device: `temp` (activations and other temporaries) and `peak` (arguments
+ outputs + temporaries). GPipe keeps every microbatch's activations until the
backward, 1F1B at most `pipeline` of them, so only GPipe's column should grow.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--microbatch-rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "circular", "1f1b"])
    parser.add_argument("--remat", default="none")
    args = parser.parse_args(argv)

    import jax

    from framework import devices
    from framework.config import (DevicesConfig, ModelConfig, OptimConfig, ParallelConfig,
                                  TrainConfig, validate)
    # Simulated CPU devices: memory analysis is per device, whatever the platform.
    devices.start(DevicesConfig(platform="cpu", local_device_count=args.pipeline),
                  ParallelConfig(pipeline=args.pipeline))
    from framework.engine import build_engine
    from framework.mesh import make_mesh
    from framework.model import init_params
    from framework.reference import tokens_for_step

    model = ModelConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers,
                        n_heads=8, n_kv_heads=4, d_ff=4 * args.d_model)
    params = jax.jit(lambda k: init_params(model, k))(jax.random.key(0))
    print(f"pipeline={args.pipeline}, {args.microbatch_rows} rows x {args.seq_len} tokens per "
          f"microbatch, d_model {args.d_model}, {args.layers} layers, remat {args.remat}; "
          f"MiB per device (temp / peak)")
    print("| microbatches | " + " | ".join(args.schedules) + " |")
    print("|---" * (len(args.schedules) + 1) + "|")
    for m in args.microbatches:
        train = TrainConfig(seq_len=args.seq_len, global_batch_size=m * args.microbatch_rows)
        cells = []
        for name in args.schedules:
            par = ParallelConfig(pipeline=args.pipeline, microbatches=m, schedule=name,
                                 virtual_stages=2 if name == "circular" else 1, remat=args.remat)
            par = validate(model, par, train, args.pipeline)
            engine = build_engine(model, par, OptimConfig(), 10, make_mesh(par))
            state = engine.init_state(params)
            tokens = tokens_for_step(0, 0, train.global_batch_size, train.seq_len, model.vocab_size)
            stats = engine.compile(state, engine.shard_batch(tokens))
            cells.append(f"{stats['memory/temp_bytes_per_device'] / 2**20:.2f} / "
                         f"{stats['memory/peak_bytes_per_device'] / 2**20:.2f}")
        print(f"| {m} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
