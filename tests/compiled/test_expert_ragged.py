"""The dropless expert exchange as the TPU compiler builds it (framework/parallel/expert.py,
`parallel.expert_exchange=auto` on a TPU mesh: ragged): a small Mixtral-like MoE step
with parallel.expert=4 on tpu:v5p-8 (4 chips, deviceless) has ragged-all-to-alls and no
dense all-to-all of the worst-case buffers, and its `expert` bytes are the comm model's.

Measured 2026-11-29 (jaxlib 0.10.2, libtpu; this model): the four exchanges of a layer
(dispatch, combine, their transposes) send 393,216 bytes per step ragged against
1,575,936 dense (the [E, N, d] buffers and their ids; `parallel.expert_exchange=dense`
on the same target), 4x (E) fewer; the expert axis as a whole 3,571,830 against
4,754,070 (the dense gradients' all-reduce, 3,178,134, is the same)."""

import importlib.util

import pytest

HAVE_TPU_AOT = importlib.util.find_spec("libtpu") is not None
pytestmark = pytest.mark.skipif(not HAVE_TPU_AOT, reason="needs pip install -e '.[aot]'")


@pytest.mark.slow  # about 10 s (a deviceless TPU compile)
def test_a_tpu_moe_step_sends_its_copies_by_ragged_all_to_all():
    import dataclasses

    from framework.analysis import audit, comm_model
    from framework.compile import program, targets
    from framework.config import ModelConfig, MoeConfig, ParallelConfig, TrainConfig
    from framework.engine.build import build_engine
    from framework.engine.validate import validate
    from framework.parallel.mesh import make_mesh
    from tests.helpers import OPTIM

    target = targets.parse("tpu:v5p-8")
    found, _, _ = program.devices_for(None, target)
    model = ModelConfig(vocab_size=256, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=128, dtype="bfloat16", family="mixtral",
                        moe=MoeConfig(experts=8, top_k=2))
    train = TrainConfig(seq_len=32, global_batch_size=8)
    par = validate(model, ParallelConfig(data=len(found), expert=4), train, len(found))
    eng = build_engine(model, par, OPTIM, train.steps, make_mesh(par, found))
    assert eng.parallel.expert_exchange == "ragged"
    text = eng.step_fn.lower(*eng.abstract_inputs(train.global_batch_size,
                                                  train.seq_len)).compile().as_text()
    found_c = audit.engine_collectives(eng, text)
    ragged = [c for c in found_c if c.kind == "ragged-all-to-all"]
    assert len(ragged) == 4 and all(c.axes == ("expert",) for c in ragged)
    copies = 2 * 32 * 2 * model.d_model * 2  # N = rows x seq x top_k, bfloat16
    assert all(c.buffer_bytes == copies for c in ragged)  # the copies, not E x them
    dense = [c for c in found_c if c.kind == "all-to-all" and c.buffer_bytes >= copies]
    assert not dense, audit.report(dense)
    got = audit.bytes_per_axis(found_c, dict(eng.mesh.shape))["expert"]
    want = comm_model.expected_bytes(eng.model, eng.parallel, train)["expert"]
    assert abs(got / want - 1) <= 0.001  # the counts and offsets: 630 bytes of 3.57 MB
    exchange = sum(c.bytes_per_step for c in ragged)
    dense_par = dataclasses.replace(eng.parallel, expert_exchange="dense")
    dense_model = comm_model.expert_bytes(eng.model, dense_par, train)
    assert exchange == comm_model.expert_bytes(eng.model, eng.parallel, train)
    assert dense_model == 4 * exchange + 3072  # E x the bytes, and the ids
