"""Ring attention on the GPU compiler, without a GPU (framework/compile): the 128k
recipe's ring runs cuDNN's fused kernel on each chunk pair that sees keys
(framework/model/fused_pieces.py), read from the optimized program's kernels."""

import importlib.util

import pytest

from framework.compile import program, targets
from tests.helpers import compose_recipe

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not importlib.util.find_spec("jax_plugins"), reason="needs pip install -e '.[aot]'")]
# the recipe's layout (context 8 x tensor 8, 4 microbatches, save_dots) on one layer
# of a shorter sequence: 16 chunks of 1,024 tokens
SMALL = ("model.n_layers=1", "model.vocab_size=4096", "train.seq_len=16384",
         "target=gpu:h100x64")


@pytest.mark.parametrize("remat, calls", [("full", 3), ("save_dots", 2)])
def test_the_ring_runs_cudnns_kernel_on_the_pairs_that_see_keys(remat, calls):
    """Three pieces a ring step (the two diagonal pairs at the first step, then the one
    whose side depends on the device; the late chunk's queries over the early keys at
    every step), each a cuDNN call in the forward, again in full remat's recomputed
    forward and once more (its backward kernel) in the backward: 3 c x 3 calls a layer
    and microbatch; under save_dots, which keeps the ring's output and log-sum-exp
    (`blockwise.ATTENDED`), no recomputed forward: 3 c x 2. (The blockwise ring's
    program at the recipe's 128k tokens and 32 layers: 4.66 million kernels a step, none
    cuDNN's, against 98,704 with cuDNN's pieces: docs/performance.md.)"""
    cfg = compose_recipe("llama3_8b_128k", *SMALL, f"parallel.remat={remat}", config="compile")
    report = program.compile_report(cfg, targets.parse(cfg.target))
    assert report["attention"] == "cudnn" and report["fits"]
    c, layers, micro = cfg.parallel.context, cfg.model.n_layers, cfg.parallel.microbatches
    assert report["kernels/attention_per_step"] == 3 * c * calls * layers * micro
