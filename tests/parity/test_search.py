"""A randomized search over valid configurations (tools/parity_search.py), with a fixed
seed: schedule, pipeline, data, tensor, microbatches, virtual stages, uneven stages,
overlapped or synchronous sends, sequence parallelism, ZeRO-1, remat, tied embeddings,
document masks, model families, sliding windows, soft-caps, bfloat16 parameters,
small model shapes and (tick schedules) the GPU dispatch drawn at random, each
configuration run twice, loss and every gradient leaf against the single-device
reference. Every registered schedule is in the draw. A longer sweep:
`python tools/parity_search.py --cases 200 --seed 1`."""

import os

import jax
import pytest

from tests.helpers import load_tool

SEED = int(os.environ.get("PARITY_SEARCH_SEED", "20261127"))
CASES = int(os.environ.get("PARITY_SEARCH_CASES", "3"))


@pytest.mark.slow
def test_random_configurations_match_the_reference_twice():
    search = load_tool("parity_search")
    failures = search.search(SEED, CASES, jax.devices())
    assert failures == [], "\n" + "\n".join(failures)


# Configurations the search found failing, kept as tests of their own once fixed.
FOUND = {
    # seed 27, case 11: zb_v, context 2, uneven stages, a Mistral window of 2 (whose
    # positions are a residual computed from constants): failed to trace, with the
    # pass-through dispatch (an int32 stash buffer typed invariant, 2026-11-27) and with
    # the GPU dispatch (F's fresh residuals typed invariant, a conditional's branches
    # then differ).
    "zb_v-cp2-uneven-window": dict(
        model=dict(vocab_size=128, d_model=32, n_layers=12, n_heads=4, n_kv_heads=4,
                   d_ff=32, tie_embeddings=False, attention="dense", attention_block_q=4,
                   attention_block_kv=512, family="mistral", sliding_window=2,
                   final_softcap=30.0, dtype="float32"),
        parallel=dict(pipeline=4, data=1, tensor=1, context=2, microbatches=8,
                      schedule="zb_v", remat="none", overlap_sends=True,
                      stage_layers=(1, 1, 1, 2, 2, 2, 1, 2)),
        train=dict(seq_len=8, global_batch_size=8, seed=44)),
}


@pytest.mark.slow  # with the GPU dispatch (the pass-through one failed alike; both are
@pytest.mark.parametrize("apart", [True], ids=["gpu-dispatch"])  # drawn by the search)
@pytest.mark.parametrize("name", sorted(FOUND))
def test_what_the_search_found_stays_fixed(name, apart):
    from framework.config import ModelConfig, ParallelConfig, TrainConfig

    search = load_tool("parity_search")
    case = FOUND[name]
    par = ParallelConfig(**case["parallel"])
    why = search.run_case(ModelConfig(**case["model"]), par, TrainConfig(**case["train"]),
                          jax.devices()[:par.n_devices], apart=apart)
    assert why is None, why


@pytest.mark.slow
def test_an_fp8_case_is_checked_against_the_fp8_engine_on_one_device():
    """The search's FP8 cases (a quarter of a long sweep; none in the CI seed's three):
    FP8 collective matmuls under a pipeline pass against the FP8 engine with data x
    microbatches microbatches, a reference percents from the full-precision one (so
    against that one they would fail)."""
    import dataclasses

    from framework.config import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
    from framework.model import reference
    from framework.model.llama import init_params

    search = load_tool("parity_search")
    model = ModelConfig(vocab_size=128, d_model=64, n_layers=4, n_heads=4, n_kv_heads=4,
                        d_ff=64, dtype="float32", fp8="tensorwise")
    par = ParallelConfig(pipeline=2, data=2, tensor=2, microbatches=2, schedule="1f1b",
                         sequence_parallel=True, collective_matmul=True)
    train = TrainConfig(seq_len=16, global_batch_size=8, seed=3)
    devices = jax.devices()[:par.n_devices]
    assert search.run_case(model, par, train, devices) is None
    params = jax.jit(lambda k: init_params(model, k))(jax.random.key(train.seed))
    tokens = reference.tokens_for_step(train.seed, 0, 8, 16, model.vocab_size)
    _, fp8_grads = search.parity_fp8.one_device(model, par, train, OptimConfig(), None,
                                                 devices[0])(
        params, tokens)
    _, full = reference.loss_and_grads(params, tokens, dataclasses.replace(model, fp8="none"),
                                       groups=4)
    assert max(search._relative_errors(fp8_grads, full)) > 100 * search.TOLERANCE
