"""Expert parallelism (`parallel.expert`, framework/parallel/expert.py) trains exactly:
the loss and every gradient on (pipe 2, data 2, tensor 2) with the experts split over 2
of the data devices equal one device's with data x microbatches microbatches, under
every tick schedule, with ZeRO-1 and with FSDP, beside context parallelism, for Qwen3-MoE (8 experts, 4 a device)
and Mixtral (4 experts, 2 a device) settings with the auxiliary and z losses on, and
Qwen3-MoE's with a gated shared expert and DeepSeek-V3's sigmoid router, and through the
ragged exchange (emulated here) (the models and the comparison: tests/parity/test_moe.py)."""

import dataclasses

import pytest

from tests.parity.test_moe import MODELS, SHARED_SIGMOID, check

BASE = dict(pipeline=2, data=2, tensor=2, microbatches=2, expert=2)
# Each path once, the two families alternating (the families' differences are
# tested on 1F1B without experts split: tests/parity/test_moe.py); the parity search
# (tools/parity_search.py) draws the other combinations. Until 2026-12-01 also 1F1B with
# ZeRO-1 (two steps below), capacity on interleaved FSDP, the ragged exchange on 1F1B
# and shared experts on 1F1B with SP and on ZB-H1 apart (one case now): each path is in
# another case here.
LAYOUTS = {
    "1f1b_fsdp": ("mixtral", dict(BASE, schedule="1f1b", fsdp=True)),
    "zb_h1_sp_remat": ("mixtral", dict(BASE, schedule="zb_h1", sequence_parallel=True,
                                       remat="full")),
    "zb_v": ("qwen3_moe", dict(BASE, schedule="zb_v")),
    # data 4 = 2 replicas x expert 2: FSDP shards the expert leaves over `data`
    "dp4_fsdp_interleaved": ("qwen3_moe", dict(pipeline=2, data=4, tensor=1, microbatches=2,
                                               schedule="interleaved_1f1b", virtual_stages=2,
                                               expert=2, fsdp=True)),
    # context 2 beside: each context device dispatches its chunks' tokens in its group
    "context_zb_h1_zero1": ("mixtral", dict(pipeline=2, data=2, tensor=1, context=2,
                                            microbatches=2, schedule="zb_h1", expert=2,
                                            zero1=True)),
    # a capacity factor (static slots, framework/model/moe.py): the same copies dropped
    # (the split backward with the slots in 2 parts: each part's matmuls weight ops)
    "capacity_zb_h1_sp": ("qwen3_moe@0.75", dict(BASE, schedule="zb_h1", expert_chunks=2,
                                                 sequence_parallel=True, zero1=True)),
    # shared experts (dense leaves: gradients summed over data and expert) and the
    # sigmoid router, beside sequence parallelism under the split backward
    "shared_sigmoid_zb_h1_sp": ("shared_sigmoid", dict(BASE, schedule="zb_h1",
                                                       sequence_parallel=True)),
    # the ragged exchange (TPU and GPU's; emulated on CPU, the same offsets and sizes:
    # framework/parallel/expert.py), under both backwards and FSDP
    "ragged_zb_h1_sp_remat": ("mixtral", dict(BASE, schedule="zb_h1", sequence_parallel=True,
                                              remat="full", expert_exchange="ragged")),
    "ragged_dp4_fsdp": ("qwen3_moe", dict(pipeline=2, data=4, tensor=1, microbatches=2,
                                          schedule="1f1b", expert=4, fsdp=True,
                                          expert_exchange="ragged")),
}
MODELS = {**MODELS, "shared_sigmoid": SHARED_SIGMOID}


def model_of(name: str):
    """"family" or "family@c": the family's test model, with capacity factor c."""
    family, _, factor = name.partition("@")
    model = MODELS[family]
    if not factor:
        return model
    return dataclasses.replace(model, moe=dataclasses.replace(
        model.moe, capacity_factor=float(factor)))


@pytest.mark.slow  # about 15 s (the fast tier's case: tests/unit/test_expert_parallel.py)
def test_experts_split_over_data_equal_one_device():
    """The smallest case: data 2 as expert 2, no pipeline (the autodiff executor)."""
    check(MODELS["mixtral"], dict(pipeline=1, data=2, tensor=1, microbatches=1, expert=2))


@pytest.mark.slow  # 20-40 s each on 2 shared cores
@pytest.mark.parametrize("name", LAYOUTS)
def test_expert_parallel_on_every_path_equals_one_device(name):
    family, layout = LAYOUTS[name]
    check(model_of(family), layout)


@pytest.mark.slow  # 10-20 s each
@pytest.mark.parametrize("kw", [
    dict(pipeline=1, data=2, microbatches=1, expert=2),
    dict(pipeline=2, data=2, tensor=2, microbatches=2, schedule="zb_h1",
         sequence_parallel=True, remat="full", expert=2),
    dict(pipeline=1, data=4, microbatches=2, expert=4, capacity=0.75),
    dict(pipeline=1, data=4, microbatches=2, expert=4, expert_exchange="ragged"),  # emulated
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_expert_axis_bytes_are_the_comm_models(kw):
    """`comm/bytes_per_step/expert` of the compiled program (the dispatch's all-to-alls
    of worst-case buffers, the dense gradients' all-reduce over `expert`) and `data`'s
    within 0.1% of framework/analysis/comm_model.py's."""
    from framework.analysis import audit, comm_model
    from tests.helpers import TRAIN, engine

    kw = dict(kw)
    factor = kw.pop("capacity", None)
    eng = engine(model=model_of(f"mixtral@{factor}" if factor else "mixtral"), **kw)
    stats = audit.step_stats(eng, *eng.abstract_inputs(TRAIN.global_batch_size,
                                                        TRAIN.seq_len))
    expected = comm_model.expected_bytes(eng.model, eng.parallel, TRAIN, permute=False)
    assert expected["expert"] > 0
    for axis, tol in (("expert", 0.001), ("data", 0.001), ("pipe", 0.01)):
        # pipe: zb_h1 + SP + remat sends 284 bytes (0.38%) more than the model's
        # 73,984 (2026-11-28, not traced yet; 1F1B equal)
        got, want = stats.get(f"comm/bytes_per_step/{axis}", 0.0), expected[axis]
        assert (got == 0 == want) or abs(got / want - 1) <= tol, (axis, got, want)


@pytest.mark.slow  # 20 s
def test_the_slots_sent_as_e4m3_save_what_the_comm_model_says():
    """With delayed FP8 the capacity slots' dispatch sends E4M3 (`model.fp8_dispatch`):
    the compiled program's `expert` bytes drop by what framework/analysis/comm_model.py
    says (a byte an element in place of the compute dtype's four here), within 0.1%.
    (The difference, not the totals: the FP8 probes' sums over `expert`, the exponent
    counts and statistics, are not in the model: 34 KB, 2.7% of this tiny model's.)"""
    from framework.analysis import audit, comm_model
    from tests.helpers import TRAIN, engine

    drop = {}
    for dispatch in (True, False):
        model = dataclasses.replace(model_of("mixtral@0.75"), fp8="delayed",
                                    fp8_dispatch=dispatch)
        eng = engine(model=model, pipeline=1, data=2, microbatches=2, expert=2)
        stats = audit.step_stats(eng, *eng.abstract_inputs(TRAIN.global_batch_size,
                                                            TRAIN.seq_len))
        sign = 1 if dispatch else -1
        drop["compiled"] = drop.get("compiled", 0) - sign * stats["comm/bytes_per_step/expert"]
        drop["model"] = drop.get("model", 0) - sign * comm_model.expected_bytes(
            eng.model, eng.parallel, TRAIN, permute=False)["expert"]
    assert drop["model"] > 0 and abs(drop["compiled"] / drop["model"] - 1) <= 0.001, drop


@pytest.mark.slow  # 20-40 s each
@pytest.mark.parametrize("kw", [
    dict(pipeline=2, data=4, microbatches=4, schedule="1f1b", expert=4, zero1=True),
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_memory_prediction_with_experts_split_within_10_percent_of_compiled(kw):
    """The memory model with the experts split over `expert` (their weights and state
    1/E, the dispatch's worst-case buffers in the traced layer's residuals). Measured
    2026-11-28 (CPU): (dp2, ep2) 1.055x, this case 1.023x; (pp2, dp2, tp2, ep2) 1F1B is 0.87x (not
    asserted: the compiled program holds about 14 MiB more than the model there)."""
    from framework.analysis import audit, memory_model
    from framework.config import ModelConfig, MoeConfig, ParallelConfig, TrainConfig
    from framework.engine.build import build_engine
    from framework.engine.validate import validate
    from framework.parallel.mesh import make_mesh
    from tests.helpers import OPTIM

    model = ModelConfig(vocab_size=512, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                        d_ff=512, dtype="float32", family="mixtral",
                        moe=MoeConfig(experts=8, top_k=2, expert_hidden=256))
    train = TrainConfig(seq_len=64, global_batch_size=16)
    par = validate(model, ParallelConfig(**kw), train, ParallelConfig(**kw).n_devices)
    eng = build_engine(model, par, OPTIM, train.steps, make_mesh(par))
    got = audit.step_stats(eng, *eng.abstract_inputs(train.global_batch_size, train.seq_len))
    predicted = memory_model.predict_memory(model, par, train)["total"]
    assert abs(predicted / got["memory/peak_bytes_per_device"] - 1) <= 0.10


@pytest.mark.slow  # about 30 s
def test_two_optimizer_steps_with_zero1_equal_the_same_layout_without_experts_split():
    """The whole train step (AdamW on ZeRO-1's shards, expert leaves sharded over `data`
    and `expert`): losses and final parameters as with parallel.expert=1 (1.2e-7 apart
    on 2026-11-28)."""
    import jax
    import numpy as np

    from tests.helpers import engine, engine_losses

    kw = dict(model=MODELS["qwen3_moe"], pipeline=1, data=4, tensor=2, microbatches=2,
              zero1=True)
    losses, final = engine_losses(engine(expert=2, **kw), 2)
    ref_losses, ref_final = engine_losses(engine(**kw), 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    diff = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                        final, ref_final)
    assert max(jax.tree.leaves(diff)) <= 1e-5
