"""The same command twice gives the same numbers, and those of one device (issue: a
1F1B run's gradients were wrong in some repeats, when its program was loaded from JAX's
persistent compilation cache: framework/runtime/devices.py, `compile_cache_safe`)."""

import json

from tests import cli

CASE = ("recipe=llama_tiny_debug", "model.n_layers=4", "model.d_model=64", "model.n_heads=4",
        "model.n_kv_heads=4", "model.d_ff=128", "model.vocab_size=256", "model.dtype=float32",
        "train.seq_len=32", "train.steps=3", "train.global_batch_size=16", "train.seed=73",
        "optim.warmup_steps=0", "profile.steps=0", "logging.every=1", "logging=no_wandb",
        "logging.progress=false")
LAYOUT = ("parallel.pipeline=2", "parallel.data=2", "parallel.tensor=1",
          "parallel.microbatches=8", "parallel.schedule=1f1b")
ONE_DEVICE = ("parallel.pipeline=1", "parallel.data=1", "parallel.tensor=1",
              "parallel.microbatches=1")


def grad_norms(run_dir) -> list[float]:
    return [json.loads(line)["train/grad_norm"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_1f1b_run_repeated_with_a_compile_cache_equals_one_device(tmp_path, env):
    """Three runs of the issue's command with a persistent compilation cache folder set
    (the one-device run, then the 1F1B run twice, which would load its program from the
    cache): the same gradient norms, those of one device, at every step."""
    env = {**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    cli.ok(cli.train(tmp_path / "one", *CASE, *ONE_DEVICE, env=env))
    want = grad_norms(tmp_path / "one")
    for i in range(2):
        cli.ok(cli.train(tmp_path / f"pp{i}", *CASE, *LAYOUT, env=env))
        got = grad_norms(tmp_path / f"pp{i}")
        assert all(abs(a - b) <= 1e-4 * b for a, b in zip(got, want)), (i, got, want)
    assert grad_norms(tmp_path / "pp0") == grad_norms(tmp_path / "pp1")
