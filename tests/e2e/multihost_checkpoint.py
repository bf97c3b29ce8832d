"""One of two processes (4 simulated CPU devices each) of test_checkpoint's multi-host
test: both save one sharded state at (2, 2, 2), then restore it at (1, 8, 1) and
(4, 1, 2), each process reading only its own shards, and read their own batch rows.

    python tests/multihost_checkpoint.py PROCESS_ID PORT FOLDER
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)


def main(process_id: int, port: int, folder: str) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id)
    import numpy as np

    from framework.io import data
    from framework.io.checkpoint.manager import Checkpointer
    from framework.engine.state import to_canonical
    from framework.config import DataConfig
    from framework.model.llama import init_params
    from tests.helpers import MODEL, TRAIN, engine

    # Random values of the parameters' shapes: compiling Flax's init costs more than
    # this whole test needs (any values do to check where each shard lands).
    shapes = jax.eval_shape(lambda: init_params(MODEL, jax.random.key(0)))
    rng = np.random.default_rng(0)
    canonical = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)
    want = canonical
    eng = engine(2, 2, 2, 2)
    ckpt = Checkpointer(folder, keep=1)
    ckpt.save(0, eng.layout, eng.init_state(canonical))
    ckpt.wait()
    for layout in [(1, 8, 1, 1), (4, 1, 2, 4)]:
        restored = to_canonical(ckpt.restore(engine(*layout).layout))["params"]
        n_shards = 0
        for got, ref in zip(jax.tree.leaves(restored), jax.tree.leaves(want)):
            for shard in got.addressable_shards:  # only this process's pieces
                assert np.array_equal(np.asarray(shard.data), ref[shard.index])
                n_shards += 1
        print(f"restored {layout} shards={n_shards}", flush=True)
    ckpt.close()

    dataset = data.make_dataset(DataConfig(kind="markov"), TRAIN, MODEL.vocab_size)
    sharding = engine(1, 8, 1, 1).batch_sharding()
    rows = data.process_rows(sharding, dataset.global_shape)
    batch = data.sharded_batch(dataset.train_batch, 3, sharding, dataset.global_shape)
    full = dataset.train_batch(3)
    for shard in batch.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), full[shard.index])
    print(f"rows={rows.min()}..{rows.max()} n={rows.size}", flush=True)
    print("OK", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
