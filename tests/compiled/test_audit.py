"""The communication audit of compiled steps (framework/analysis/audit.py): which
collectives run over which mesh axis, how often and how many bytes, against what the
math requires (framework/analysis/comm_model.py); and the bubble read from the program."""

import dataclasses

import jax
import numpy as np
import pytest

from framework.analysis import audit, comm_model, hlo, profiling
from tests.helpers import MODEL, TRAIN, engine, params, tokens


def compiled_collectives(eng):
    state = eng.init_state(params(eng.model))
    text = eng.step_fn.lower(state, eng.shard_batch(tokens(0))).compile().as_text()
    return audit.collectives(text, dict(eng.mesh.shape))


@pytest.fixture(scope="module")
def audit_222():
    eng = engine(2, 2, 2, 4)
    return eng, compiled_collectives(eng)


def mesh_coords(eng, device_index):
    return np.unravel_index(device_index, tuple(eng.mesh.shape.values()))


def test_permutes_only_between_neighbouring_pipe_stages(audit_222):
    eng, found = audit_222
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert permutes, "the pipeline must move activations with collective-permutes"
    for c in permutes:
        assert c.axes == ("pipe",)
        for src, dst in c.pairs:
            (ps, *rest_s), (pd, *rest_d) = mesh_coords(eng, src), mesh_coords(eng, dst)
            assert rest_s == rest_d and abs(int(ps) - int(pd)) == 1


def test_tensor_reductions_inside_every_layer(audit_222):
    eng, found = audit_222
    ticks = eng.schedule.forward_rows().n_ticks
    layers_per_stage = MODEL.n_layers // 2
    in_loop = [c for c in found if c.kind == "all-reduce" and c.axes == ("tensor",)
               and "/Block/" in c.op_name]
    # Megatron-LM: one reduction in attention and one in the MLP, forward and backward,
    # for every layer on every tick.
    assert sum(c.executions for c in in_loop) == 4 * ticks * layers_per_stage
    mb_tokens = TRAIN.global_batch_size // (2 * 4) * TRAIN.seq_len
    for c in in_loop:
        assert c.buffer_bytes == mb_tokens * MODEL.d_model * 4


def test_gradients_reduced_over_data_once_per_step(audit_222):
    eng, found = audit_222
    over_data = [c for c in found if "data" in c.axes]
    assert all(c.executions == 1 for c in over_data)
    # The whole gradient (this device's pipe/tensor shard of it) crosses `data` once.
    specs = eng.state_shardings["params"]
    shard_bytes = sum(int(np.prod(s.shard_shape(p.shape))) * 4 for p, s in zip(
        jax.tree.leaves(eng.abstract_params()), jax.tree.leaves(specs)))
    reduced = sum(c.buffer_bytes for c in over_data if c.kind == "all-reduce")
    assert shard_bytes <= reduced <= shard_bytes + 1024  # + a few scalars (loss, norms)


def test_no_full_weight_is_gathered(audit_222):
    eng, found = audit_222
    full_shapes = set()
    for p in jax.tree.leaves(eng.abstract_params()):
        full_shapes |= {tuple(p.shape), tuple(p.shape[3:])}  # stacked, and one layer
    for c in found:
        if c.kind == "all-gather":
            assert not any(tuple(s) in full_shapes for _, s in c.shapes), c


@pytest.mark.parametrize("pp,mb", [pytest.param(2, 1, marks=pytest.mark.slow),
                                   pytest.param(2, 4, marks=pytest.mark.slow),
                                   pytest.param(4, 4, marks=pytest.mark.slow), (4, 8)])
def test_gpipe_bubble_read_from_the_compiled_program(pp, mb):
    """The compiled step's pipeline loop runs as many ticks as the schedule's forward
    rows, and each rank is busy in m of them (its microbatches): the bubble read from
    the program, 1 - m / ticks, is GPipe's (p-1)/(m+p-1) (Huang et al. 2019), and so is
    the table's count of idle cells that the run logs."""
    model = dataclasses.replace(MODEL, n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)
    train = dataclasses.replace(TRAIN, global_batch_size=8, seq_len=8)
    eng = engine(pp, 1, 1, mb, model=model, train=train)
    state, batch = eng.abstract_inputs(train.global_batch_size, train.seq_len)
    program = hlo.parse(eng.step_fn.lower(state, batch).compile().as_text())
    trips = {i.trip_count for instrs in program.computations.values() for i in instrs
             if profiling._loop_label(i) == "forward"}
    expected = (pp - 1) / (mb + pp - 1)
    assert len(trips) == 1 and 1 - mb / trips.pop() == pytest.approx(expected)
    assert eng.schedule.bubble_fraction == pytest.approx(expected)


# --- Bytes per mesh axis against what the math requires (framework/analysis/comm_model.py)

def comm_ratio(**kw):
    train = dataclasses.replace(TRAIN, global_batch_size=32)
    eng = engine(train=train, **kw)
    stats = audit.step_stats(eng, *eng.abstract_inputs(train.global_batch_size, train.seq_len))
    expected = comm_model.expected_bytes(eng.model, eng.parallel, train)
    return {a: stats[f"comm/bytes_per_step/{a}"] / expected[a] for a in ("pipe", "data", "tensor")}, eng


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v,sp", [
    ("gpipe", 1, False), ("gpipe", 1, True), ("circular", 2, False), ("1f1b", 1, False),
    ("interleaved_1f1b", 2, False), ("zb_h1", 1, True)], ids=lambda x: str(x))
def test_measured_communication_within_10_percent_of_expected(schedule, v, sp):
    # 4 microbatches: a bubble, whose idle ticks must not communicate (nor send on `pipe`).
    ratios, eng = comm_ratio(pipeline=2, data=2, tensor=2, microbatches=4, schedule=schedule,
                             virtual_stages=v, sequence_parallel=sp)
    print(schedule, ratios)
    for axis, ratio in ratios.items():
        assert 0.99 <= ratio <= 1.1, (axis, ratio)


@pytest.mark.slow
def test_sequence_parallel_swaps_all_reduce_for_reduce_scatter_and_all_gather():
    counts = {}
    for sp in (False, True):
        eng = engine(2, 2, 2, 4, sequence_parallel=sp)
        state = eng.init_state(params())
        text = eng.step_fn.lower(state, eng.shard_batch(tokens(0))).compile().as_text()
        in_layers = [c for c in audit.engine_collectives(eng, text)
                     if c.axes == ("tensor",) and "/Block/" in c.op_name]
        counts[sp] = {k: sum(c.executions for c in in_layers if c.kind == k)
                      for k in ("all-reduce", "all-gather", "reduce-scatter")}
    # Each rank is busy on 4 of its 5 ticks (idle ticks skip the layers) x 4 layers per
    # stage; per layer 2 reductions forward and 2 backward.
    ticks_layers = 4 * 4
    assert counts[False] == {"all-reduce": 4 * ticks_layers, "all-gather": 0, "reduce-scatter": 0}
    assert counts[True] == {"all-reduce": 0, "all-gather": 4 * ticks_layers,
                            "reduce-scatter": 4 * ticks_layers}
