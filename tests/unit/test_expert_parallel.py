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
from framework.parallel.expert import ExpertParallel
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


def test_dispatch_and_combine_send_each_copy_to_its_experts_device_and_back():
    """On (data 1 x expert 4) devices, each with 6 copies: every device receives exactly
    the copies of its experts (tagged with their local ids), and `combine` returns each
    copy's row, here the row plus 100 x its expert's global id."""
    e, local, n = 4, 2, 6
    mesh = jax.make_mesh((e,), (EXPERT,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:e])
    ep = ExpertParallel(EXPERT, e)
    ids = jax.random.randint(jax.random.key(1), (e, n), 0, e * local)
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


def test_the_planner_enumerates_expert_degrees_for_a_mixture_of_experts_only():
    from framework.analysis import planner

    layouts = planner.enumerate_layouts(MOE, TRAIN, 8, ParallelConfig(), schedules=["1f1b"])
    degrees_of = {(p.pipeline, p.data, p.tensor, p.expert) for p in layouts}
    assert {(1, 8, 1, 2), (1, 8, 1, 4), (2, 4, 1, 4), (1, 4, 2, 2)} <= degrees_of
    assert all(p.data % p.expert == 0 and MOE.moe.experts % p.expert == 0 for p in layouts)
    dense = dataclasses.replace(MOE, family="llama", moe=MoeConfig())
    assert {p.expert for p in planner.enumerate_layouts(dense, TRAIN, 8, ParallelConfig(),
                                                       schedules=["1f1b"])} == {1}
