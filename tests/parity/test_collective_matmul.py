"""The collective matmul (framework/parallel/tensor.py): sequence parallelism's
all-gather + matmul and matmul + reduce-scatter as rings of sequence blocks, exact
against the single-device reference (loss and every gradient), with pipelines, remat
and ZeRO-1; and it really replaces the collectives (the step's own program)."""

import pytest

from framework.analysis import audit
from tests.helpers import engine, engine_grads, max_rel_err, reference_grads, worst

CM = dict(sequence_parallel=True, collective_matmul=True)


@pytest.fixture(scope="module")
def ref():
    return reference_grads()


@pytest.mark.parametrize("kw", [
    pytest.param(dict(pipeline=1, data=2, tensor=4, microbatches=1), marks=pytest.mark.slow),
    dict(pipeline=2, data=2, tensor=2, microbatches=4, schedule="1f1b", remat="full"),
    pytest.param(dict(pipeline=2, data=1, tensor=4, microbatches=4,
                      schedule="interleaved_1f1b", virtual_stages=2, zero1=True),
                 marks=pytest.mark.slow),
    pytest.param(dict(pipeline=2, data=1, tensor=2, microbatches=4, schedule="zb_h1",
                      remat="save_dots"), marks=pytest.mark.slow),
    # a split backward's B and W under save_dots: the stack's regathering rings (6 s)
    dict(pipeline=2, data=2, tensor=2, microbatches=4, schedule="zb_v", remat="save_dots"),
    dict(pipeline=2, data=2, tensor=2, microbatches=4, schedule="1f1b",
         remat="save_dots_gathered"),  # the gathered blocks kept for the backward
    dict(pipeline=1, data=2, tensor=4, microbatches=2, remat="save_dots"),  # gathered again
    pytest.param(dict(pipeline=1, data=2, tensor=4, microbatches=2, remat="save_dots_gathered",
                      collective_matmul=False), marks=pytest.mark.slow),  # f's all-gather's
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_collective_matmul_parity(kw, ref):
    loss, grads = engine_grads(engine(**{**CM, **kw}))
    assert abs(loss - float(ref[0])) <= 1e-5 * float(ref[0])
    assert worst(max_rel_err(grads, ref[1])) <= 1e-4


def _tensor_collectives(cm: bool, target: str = "gpu:h100x8"):
    """The tensor-parallel collectives in the layers of llama_1b_8gpu's step (pipeline
    2 x data 2 x tensor 2, 1F1B, sequence parallel) compiled for `target` (compile-only
    devices). The 1B model: on the tiny one the scheduler's cost model rightly keeps
    most of a few KiB's transfers beside elementwise work."""
    from framework.compile import program, targets
    from framework.engine.build import build_engine
    from framework.engine.validate import validate
    from framework.parallel.mesh import make_mesh
    from tests.helpers import compose_recipe

    cfg = compose_recipe("llama_1b_8gpu", f"target={target}", "parallel.schedule=1f1b",
                         "parallel.sequence_parallel=true", "parallel.remat=full",
                         f"parallel.collective_matmul={str(cm).lower()}", config="compile")
    found, platform, _ = program.devices_for(cfg, targets.parse(cfg.target))
    parallel = validate(cfg.model, cfg.parallel, cfg.train, len(found))
    eng = build_engine(cfg.model, parallel, cfg.optim, cfg.train.steps,
                       make_mesh(parallel, found))
    state, batch = eng.abstract_inputs(cfg.train.global_batch_size, cfg.train.seq_len)
    with targets.cudnn_of(targets.parse(cfg.target)):  # cuDNN's attention, no library
        text = eng.step_fn.lower(state, batch).compile(
            compiler_options=program.compiler_options(platform)).as_text()
    return [c for c in audit.engine_collectives(eng, text)
            if c.axes == ("tensor",) and "/Block/" in c.op_name]


@pytest.mark.slow  # 11 s: the fast tier's time
def test_the_rings_replace_the_all_gathers_and_reduce_scatters():
    """On the GPU compiler: in the layers no all-gather or reduce-scatter over `tensor`
    is left, the rings' permutes send the same bytes per step (so the comm model holds
    unchanged), and they run beside the blocks' matmuls."""
    plain, rings = _tensor_collectives(False), _tensor_collectives(True)
    assert {c.kind for c in plain} == {"all-gather", "reduce-scatter"}
    assert {c.kind for c in rings} == {"collective-permute"}
    sent = [sum(c.bytes_per_step for c in cs) for cs in (plain, rings)]
    assert sent[1] == pytest.approx(sent[0], rel=1e-6)
    beside = [sum(c.bytes_per_step for c in cs if c.overlapped) / sum(
        c.bytes_per_step for c in cs) for cs in (plain, rings)]
    assert beside[1] >= 0.9 and beside[1] > beside[0] + 0.5, beside  # 2026-11-26: 1.0, 0.18
