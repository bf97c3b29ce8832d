"""Expert parallelism (`parallel.expert`, framework/parallel/expert.py): its settings
refused in one line each before anything is compiled, its mesh and its name, and the
dispatch's exchange on simulated devices (the parity with one device:
tests/parity/test_expert_parallel.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from framework.config import ModelConfig, MoeConfig, ParallelConfig, TrainConfig
from framework.engine.validate import check, validate
from framework.errors import ConfigError
from framework.engine.resolved import exchange_for
from framework.parallel.expert import ExpertParallel, emulated_ragged_all_to_all, ragged_sends
from framework.parallel.mesh import DATA, EXPERT, degrees, make_mesh, mesh_axes, mesh_name

MOE = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  family="mixtral", moe=MoeConfig(experts=4, top_k=2))
TRAIN = TrainConfig(seq_len=8, global_batch_size=8)


def errors(model=MOE, **parallel):
    return check(model, ParallelConfig(**parallel), TRAIN, None)


@pytest.mark.parametrize("model, parallel, message", [
    (MOE, dict(data=8, expert=8),
     "model.moe.experts=4 is not divisible by parallel.expert=8: use expert in {1, 2, 4}"),
    (dataclasses.replace(MOE, moe=MoeConfig(experts=6, top_k=2)), dict(data=4, expert=3),
     "parallel.expert=3 does not divide parallel.data=4 (the expert devices are carved out "
     "of the data replicas): use expert in {1, 2, 4}"),
    (dataclasses.replace(MOE, family="llama", moe=MoeConfig()), dict(data=2, expert=2),
     "parallel.expert=2 needs a mixture-of-experts model (model.moe.experts >= 1, e.g. "
     "model.family=qwen3_moe): use parallel.expert=1"),
    (MOE, dict(data=2, expert=0), "parallel.expert=0 must be >= 1 (1: no expert parallelism)"),
])
def test_bad_expert_settings_are_one_line_each(model, parallel, message):
    assert errors(model, **parallel) == [message]
    with pytest.raises(ConfigError, match="parallel.expert"):
        validate(model, ParallelConfig(**parallel), TRAIN, None)


def test_good_expert_settings_pass_and_data_minus_one_is_checked_once_resolved():
    assert errors(data=4, expert=4) == errors(data=2, expert=2, tensor=2) == []
    assert errors(data=2, context=2, expert=2) == []
    with pytest.raises(ConfigError, match="does not divide parallel.data=3"):
        validate(dataclasses.replace(MOE, moe=MoeConfig(experts=6, top_k=2)),
                 ParallelConfig(data=-1, expert=2), TRAIN, 3)


def test_the_expert_axis_is_carved_out_of_data_and_absent_at_degree_one():
    p = ParallelConfig(pipeline=2, data=4, tensor=1, microbatches=2, expert=2)
    assert mesh_axes(p) == ("pipe", "data", "expert", "context", "tensor")
    assert degrees(p) == {"pipe": 2, "data": 2, "expert": 2, "context": 1, "tensor": 1}
    assert p.n_devices == 8 and mesh_name(p) == "pp2-dp4-tp1-mb2-ep2"
    assert make_mesh(p).shape == {"pipe": 2, "data": 2, "expert": 2, "context": 1, "tensor": 1}
    one = dataclasses.replace(p, expert=1)
    assert EXPERT not in mesh_axes(one) and mesh_name(one) == "pp2-dp4-tp1-mb2"


@pytest.mark.parametrize("exchange", ["dense", "emulated"])
@pytest.mark.parametrize("skew", [False, True], ids=["random", "all_to_device_1"])
def test_dispatch_and_combine_send_each_copy_to_its_experts_device_and_back(exchange, skew):
    """On (data 1 x expert 4) devices, each with 6 copies: every device receives exactly
    the copies of its experts (tagged with their local ids), and `combine` returns each
    copy's row, here the row plus 100 x its expert's global id. Skewed: every copy goes
    to device 1 (the ragged receive buffer's worst case, the others receive nothing)."""
    e, local, n = 4, 2, 6
    mesh = jax.make_mesh((e,), (EXPERT,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:e])
    ep = ExpertParallel(EXPERT, e, exchange)
    ids = jax.random.randint(jax.random.key(1), (e, n), 0, e * local)
    ids = ids % local + local if skew else ids
    rows = jnp.arange(e * n, dtype=jnp.float32).reshape(e, n, 1)

    def body(rows, ids):
        got, got_ids, state = ep.dispatch(rows[0], ids[0], local)
        me = jax.lax.axis_index(EXPERT)
        out = got + 100.0 * jnp.where(got_ids < local, got_ids + me * local, -1)[:, None]
        return ep.combine(out, state)[None], got_ids[None]

    back, got_ids = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(EXPERT), P(EXPERT)),
                                          out_specs=(P(EXPERT), P(EXPERT))))(rows, ids)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(rows + 100.0 * ids[..., None]))
    for device in range(e):  # the real (not padding) rows each device received
        mine = np.asarray(got_ids[device])
        expected = np.sort(np.asarray(ids)[np.asarray(ids) // local == device] % local)
        np.testing.assert_array_equal(np.sort(mine[mine < local]), expected)
    assert DATA not in mesh.axis_names


def numpy_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets,
                            recv_sizes):
    """jax.lax.ragged_all_to_all's semantics (its docstring's pseudocode), every device's
    arguments stacked [E, ...]: device i's slice k goes to device k // (K / E), at
    i's output_offsets[k], with the receiver's recv_sizes for it."""
    e, k = input_offsets.shape
    per = k // e
    results = [np.array(o) for o in outputs]
    for i in range(e):
        for s in range(k):
            j, slot = s // per, i * per + s % per  # receiver, the slice's index there
            rows = operands[i][input_offsets[i, s]:input_offsets[i, s] + send_sizes[i, s]]
            assert len(rows) == recv_sizes[j, slot]
            results[j][output_offsets[i, s]:output_offsets[i, s] + len(rows)] = rows
    return np.stack(results)


@pytest.mark.parametrize("case", ["docstring", "empty_sends", "all_to_one", "two_slices"])
def test_the_emulated_ragged_all_to_all_has_the_primitives_semantics(case):
    """`emulated_ragged_all_to_all` against a numpy model of jax.lax.ragged_all_to_all's
    documented semantics, on 2 or 4 simulated devices: its docstring's example, empty
    sends, every device sending everything to device 0, two slices per destination."""
    i32 = lambda x: np.array(x, np.int32)
    if case == "docstring":  # operand, output rows, then per device (in, send, out, recv)
        operand = np.array([[1, 2, 2], [3, 4, 0]], np.float32)
        args = [i32([[0, 1], [0, 1]]), i32([[1, 2], [1, 1]]), i32([[0, 0], [1, 2]]),
                i32([[1, 1], [2, 1]])]
        out_rows = 4
    else:
        e, m = 4, 5
        operand = np.arange(e * m, dtype=np.float32).reshape(e, m) + 1
        if case == "two_slices":  # device i sends rows [0,1) and [1,3) to each j
            sizes = np.tile(i32([1, 2]), (e, e))  # [E, 2E]
            offs = np.tile(i32([0, 1]), (e, e))
        else:
            sizes = (np.zeros((e, e), np.int32) if case == "empty_sends" else
                     np.zeros((e, e), np.int32) + i32([[m, 0, 0, 0]]))
            sizes[1, 2] = 2 if case == "empty_sends" else sizes[1, 2]  # one send
            offs = np.cumsum(sizes, axis=1) - sizes
        per = sizes.shape[1] // e
        # received slices, sender-major at each receiver: slot i per + t from sender i
        recv = sizes.reshape(e, e, per).transpose(1, 0, 2).reshape(e, -1)  # [E recv, K]
        out_offs = (np.cumsum(recv, axis=1) - recv).reshape(e, e, per).transpose(1, 0, 2)
        args = [offs, sizes, out_offs.reshape(e, -1).astype(np.int32), recv.astype(np.int32)]
        out_rows = e * m
    e = operand.shape[0]
    outputs = np.full((e, out_rows), -1.0, np.float32)
    mesh = jax.make_mesh((e,), (EXPERT,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:e])

    def body(operand, output, *offsets):
        return emulated_ragged_all_to_all(operand[0], output[0], *(o[0] for o in offsets),
                                          axis_name=EXPERT)[None]

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(EXPERT),) * 6,
                                out_specs=P(EXPERT)))(operand, outputs, *args)
    want = numpy_ragged_all_to_all(operand, outputs, *args)
    np.testing.assert_array_equal(np.asarray(got), want)
    if case == "docstring":
        np.testing.assert_array_equal(want, [[1, 3, -1, -1], [2, 2, 4, -1]])


def test_ragged_sends_are_the_exchange_and_its_transpose_the_way_back():
    """The offsets of a 3-device exchange (copies from i to j: matrix[i, j]): sender 1's
    runs start where its sorted copies do, land after sender 0's in each receiver's
    buffer, and the matrix transposed sends each receiver's rows back where they came
    from."""
    matrix = jnp.array([[2, 0, 1], [1, 3, 0], [0, 2, 2]], jnp.int32)
    got = [np.asarray(a).tolist() for a in ragged_sends(matrix, 1)]
    assert got == [[0, 1, 4], [1, 3, 0], [2, 0, 1], [0, 3, 2]]
    back = [np.asarray(a).tolist() for a in ragged_sends(matrix.T, 1)]
    assert back == [[0, 0, 3], [0, 3, 2], [2, 1, 0], [1, 3, 0]]


def test_the_platform_decides_the_exchange():
    assert exchange_for("auto", "tpu") == exchange_for("auto", "cuda") == "ragged"
    assert exchange_for("auto", "cpu") == "dense"
    assert exchange_for("ragged", "cpu") == "emulated"
    assert exchange_for("dense", "tpu") == "dense" and exchange_for("emulated", "tpu") == "emulated"


def test_the_planner_enumerates_expert_degrees_for_a_mixture_of_experts_only():
    from framework.analysis import planner

    layouts = planner.enumerate_layouts(MOE, TRAIN, 8, ParallelConfig(), schedules=["1f1b"])
    degrees_of = {(p.pipeline, p.data, p.tensor, p.expert) for p in layouts}
    assert {(1, 8, 1, 2), (1, 8, 1, 4), (2, 4, 1, 4), (1, 4, 2, 2)} <= degrees_of
    assert all(p.data % p.expert == 0 and MOE.moe.experts % p.expert == 0 for p in layouts)
    dense = dataclasses.replace(MOE, family="llama", moe=MoeConfig())
    assert {p.expert for p in planner.enumerate_layouts(dense, TRAIN, 8, ParallelConfig(),
                                                       schedules=["1f1b"])} == {1}


def test_the_executor_state_of_an_expert_layout_is_its_own_whatever_was_asked_before():
    """The planner asks for hundreds of layouts and `executor_state` keeps one trace per
    shape of the state: an expert layout must not be answered with the state of the same
    layout at expert 1 (until 2026-11-29 it was, and the planner counted Mixtral's every
    expert's gradients on each device without FSDP: 139.7 GiB for a layout that compiles
    to 62 GiB on the GPU compiler)."""
    from framework.analysis import executor_state as es

    base = ParallelConfig(pipeline=2, data=4, microbatches=4, schedule="1f1b", zero1=True)
    experts = dataclasses.replace(base, expert=4)
    es._STATES.clear()
    alone = es.executor_state(MOE, experts, 32, 8, "cpu")["grads"]
    es._STATES.clear()
    dense = es.executor_state(MOE, base, 32, 8, "cpu")["grads"]
    after = es.executor_state(MOE, experts, 32, 8, "cpu")["grads"]
    assert after == alone < dense
