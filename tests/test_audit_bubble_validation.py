"""Communication audit, bubble accounting and input validation of the core engine."""

import dataclasses

import jax
import numpy as np
import pytest

from framework.analysis import audit
from framework.errors import ConfigError
from framework.config import ParallelConfig, TrainConfig
from framework.engine.validate import validate
from tests.helpers import MODEL, TRAIN, engine, params, tokens


def compiled_collectives(eng):
    state = eng.init_state(params(eng.model))
    hlo = eng.step_fn.lower(state, eng.shard_batch(tokens(0))).compile().as_text()
    return audit.collectives(hlo, dict(eng.mesh.shape))


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
            (ps, ds, ts), (pd, dd, td) = mesh_coords(eng, src), mesh_coords(eng, dst)
            assert (ds, ts) == (dd, td) and abs(int(ps) - int(pd)) == 1


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


@pytest.mark.parametrize("pp,mb", [(2, 1), (2, 4), (4, 4), (4, 8)])
def test_gpipe_bubble_table_equals_theory(pp, mb):
    model = dataclasses.replace(MODEL, n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)
    train = dataclasses.replace(TRAIN, global_batch_size=8, seq_len=8)
    eng = engine(pp, 1, 1, mb, model=model, train=train)
    state = eng.init_state(params(model))
    _, metrics = eng.step(state, eng.shard_batch(tokens(0, train, model)))
    host = eng.host_metrics(metrics)
    expected = (pp - 1) / (mb + pp - 1)  # GPipe, Huang et al. 2019
    assert host["pipeline/bubble_fraction"] == pytest.approx(expected)
    assert host["pipeline/bubble_fraction_table"] == pytest.approx(expected)
    assert eng.schedule.bubble_fraction == pytest.approx(expected)


BAD = [  # (overrides, the setting the message must name)
    (dict(pipeline=2, data=2, tensor=1), "parallel.pipeline*data*tensor"),  # 4 != 8
    (dict(pipeline=3, data=1, tensor=1), "model.n_layers"),
    (dict(pipeline=1, data=8, tensor=1, microbatches=4), "train.global_batch_size"),
    (dict(pipeline=0, data=8, tensor=1), "parallel.pipeline"),
    (dict(pipeline=1, data=-3, tensor=1), "parallel.data"),
    (dict(pipeline=1, data=2, tensor=1, schedule="zigzag"), "parallel.schedule"),
]


@pytest.mark.parametrize("overrides,setting", BAD, ids=[s for _, s in BAD])
def test_bad_degrees_raise_one_clear_line(overrides, setting):
    with pytest.raises(ConfigError) as err:
        validate(MODEL, ParallelConfig(**overrides), TRAIN, 8)
    message = str(err.value)
    assert setting in message and "\n" not in message


def test_each_divisibility_rule_is_checked():
    cases = {
        "model.n_heads": dataclasses.replace(MODEL, n_heads=6, n_kv_heads=2, d_model=48),
        "model.n_kv_heads": dataclasses.replace(MODEL, n_kv_heads=2),  # tensor=4
        "model.d_ff": dataclasses.replace(MODEL, d_ff=130),
        "model.vocab_size": dataclasses.replace(MODEL, vocab_size=130),
    }
    for setting, model in cases.items():
        with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
            validate(model, ParallelConfig(pipeline=1, data=2, tensor=4), TRAIN, 8)


def test_data_minus_one_fills_devices_and_few_microbatches_warns():
    par = validate(MODEL, ParallelConfig(pipeline=2, data=-1, tensor=2, microbatches=2),
                   TRAIN, 8)
    assert par.data == 2
    with pytest.warns(UserWarning, match="bubble will exceed 50%"):
        validate(MODEL, ParallelConfig(pipeline=4, data=1, tensor=2, microbatches=2), TRAIN, 8)


def test_comm_audit_command_line_lists_collectives_and_axes():
    import subprocess
    import sys
    from pathlib import Path
    tool = Path(__file__).resolve().parents[1] / "tools" / "comm_audit.py"
    proc = subprocess.run([sys.executable, str(tool), "recipe=llama_tiny_debug"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("collective-permute") and " pipe " in line for line in lines)
    axes = {line.split()[0]: line.split() for line in lines if line.split()[:1] in
            (["pipe"], ["data"], ["tensor"])}
    assert set(axes) == {"pipe", "data", "tensor"}
    for axis, (_, measured, expected, ratio) in axes.items():
        assert float(measured.replace(",", "")) > 0 and float(ratio) >= 0.99, axis
    bad = subprocess.run([sys.executable, str(tool), "recipe=llama_tiny_debug",
                          "parallel.pipeline=3"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
