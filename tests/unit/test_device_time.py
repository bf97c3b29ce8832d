"""The profile's breakdown (framework/analysis/device_time.py): ops sorted into kinds by
name and custom-call target, a loop's or conditional's event not counted beside the ops
it spans, per-step sums and kernel counts, on a made-up timeline and on a real CPU
profile."""

import os
import tempfile
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import pytest

from framework.analysis import device_time as dt


@pytest.mark.parametrize("op, target, kind", [
    ("gemm_fusion_dot.12", "", "matmul"),
    ("custom-call.3", "__cublas$gemm", "matmul"),
    ("custom-call.7", "__cudnn$fmhaSoftmax", "attention"),
    ("loop_dynamic_update_slice_fusion.4", "", "copies/slices"),
    ("copy.19", "", "copies/slices"),
    ("all-reduce-start.2", "", "collectives"),
    ("collective-permute-done", "", "collectives"),
    ("loop_multiply_fusion.8", "", "elementwise"),
    ("command_buffer.1", "", "other"),
])
def test_each_op_kind(op, target, kind):
    assert dt.kind_of(op, target) == kind


def _event(start, ns, op):
    return NS(start_ns=start, duration_ns=ns, stats=[("hlo_op", op)])


def test_a_loop_is_not_counted_beside_the_ops_it_runs():
    line = NS(name="XLA Ops", events=[
        _event(0, 100, "while.1"), _event(0, 30, "gemm_fusion_dot.1"),
        _event(40, 50, "copy.2"), _event(200, 10, "loop_add_fusion"),
        _event(300, 5, "other_line_op")])
    host = NS(name="/host:CPU", lines=[NS(name="python", events=[_event(0, 999, "x")])])
    profile = NS(planes=[host, NS(name="/device:GPU:0", lines=[line])])
    events = dt.op_events(profile)
    assert sorted(op for op, _ in events) == ["copy.2", "gemm_fusion_dot.1",
                                              "loop_add_fusion", "other_line_op"]
    found = dt.breakdown(events, steps=2)
    assert found.kernels == 2
    assert found.seconds["matmul"] == pytest.approx(15e-9)
    assert found.seconds["copies/slices"] == pytest.approx(25e-9)
    assert found.top[0][:2] == ("copy", "copies/slices")


def test_targets_are_read_from_the_program_text():
    text = ('  %custom-call.7 = (bf16[2,4]{1,0}) custom-call(%p), '
            'custom_call_target="__cudnn$fmhaSoftmax", backend_config={}\n'
            '  ROOT %custom-call.2 = f32[4] custom-call(%q), custom_call_target="__cublas$gemm"')
    assert dt.custom_call_targets(text) == {"custom-call.7": "__cudnn$fmhaSoftmax",
                                            "custom-call.2": "__cublas$gemm"}


def test_a_real_profile_on_this_cpu():
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    a = jnp.ones((128, 128))
    f(a).block_until_ready()
    with tempfile.TemporaryDirectory() as folder:
        found = dt.profile_steps(lambda: f(a).block_until_ready(), 2, folder)
    assert found.kernels >= 1 and found.total > 0
    assert "device time per step" in found.lines()[0]


def test_a_profiled_tool_turns_cuda_graphs_off_and_says_so(monkeypatch):
    """A CUDA graph hides the kernels it launches from the profiler (an H200's profile saw
    237 of 466 ms, all as one "other" op a graph): `--profile` turns them off, keeping
    the flags a user set, and the tool prints why its steps are slower; without it the
    flags stay as they were."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert dt.ungraphed(["tools/bench.py", "recipe=r"]) == ""
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    note = dt.ungraphed(["tools/bench.py", "--profile"])
    assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", dt.NO_GRAPHS]
    assert "CUDA graphs off" in note and dt.NO_GRAPHS in note
