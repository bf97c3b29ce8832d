"""The benchmark's machinery on a tiny configuration: it produces finite positive
timings, the framework/reference ratio, MFU inputs, compile times and the Markdown
table (tools/bench.py, tools/bench_measure.py, tools/bench_report.py). No timing
assertions: performance is measured by tools/bench.py itself."""

import dataclasses
import math

import jax
import pytest

from framework.errors import ConfigError
from framework.parallel.mesh import mesh_name
from tools import bench
from tools.bench_measure import (REFERENCE, Row, Timing, compile_times, host_matmul_peak,
                                 measure, reference_ratio)
from tools.bench_report import headline, table
from tools.recipe import compose


@pytest.fixture(scope="module")
def cfg():
    return compose(["recipe=llama_tiny_debug"])


def test_layouts_put_the_reference_shaped_single_device_first(cfg):
    layouts = bench.layouts_for(cfg, ["2,1,4:microbatches=4:schedule=1f1b:zero1=true"], True)
    one = layouts[0]
    assert (one.n_devices, one.microbatches, one.remat, one.schedule) == (1, 1, "none", "gpipe")
    assert [(p.pipeline, p.data, p.tensor) for p in layouts] == [
        (1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (2, 1, 4)]
    assert layouts[-1].schedule == "1f1b" and layouts[-1].zero1 and layouts[-1].microbatches == 4
    with pytest.raises(ConfigError, match="not a parallel"):
        bench.parse_layout("2,1,1:micro=4", cfg.parallel)


@pytest.mark.slow
def test_measure_gives_finite_times_and_a_reference_ratio(cfg):
    one = bench.layouts_for(cfg, [], False)[0]
    found = measure(cfg, [one], jax.devices(), Timing(steps=2, rounds=2, warmup=1, pairs=3),
                    log=lambda *_: None)
    rows, ref, pairs = found.rows, found.ref, found.pairs
    for row in rows + [ref]:
        assert len(row.times) == 4 and len(row.rounds) == 2
        assert all(math.isfinite(t) and t > 0 for t in row.times)
        assert row.compile_s > 0
    assert rows[0].peak_bytes > 0 and rows[0].predicted_bytes > 0
    assert len(pairs) == 3 and all(a > 0 and b > 0 for a, b in pairs)
    ratio = reference_ratio(found)
    for key in ("paired", "median_of_rounds", "of_medians", "of_minima"):
        assert math.isfinite(ratio[key]) and ratio[key] > 0, key
    assert len(ratio["rounds"]) == 2 and len(ratio["pairs"]) == 3
    # A row on 8 simulated devices (timings made up: the table only formats them).
    sim = Row(mesh_name(cfg.parallel), cfg.parallel, 8, times=[0.02, 0.03], rounds=[0.02])
    text = "\n".join(table(cfg, rows + [sim], ref, peak_flops=1e11, per_device_peak=False,
                           simulated=True))
    assert "| 8 (simulated) |" in text and "| 1 |" in text and "reference (plain JAX)" in text
    assert text.count("\n") == 2 + len(rows) + 1  # header, rule, layouts, reference


@pytest.mark.slow
def test_host_peak_and_compile_times_are_positive(cfg):
    assert host_matmul_peak(jax.devices()[0], n=256, reps=3) > 1e6  # FLOP/s
    small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=1))
    par = bench.layouts_for(small, [], False)[0]
    times = compile_times(small, par, jax.devices(), layers=(1, 2), reps=1)
    assert set(times) == {1, 2} and all(t[0] > 0 for t in times.values())


def test_attention_rows_and_a_reference_shape_that_does_not_fit(cfg):
    from framework.runtime.devices import DeviceSet

    gpu = DeviceSet(devices=(object(),), platform="gpu", simulated=False, kind="NVIDIA H100")
    bf16 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))
    own = bench.layouts_for(bf16, [], False)
    rows = bench.attention_rows(bf16, gpu, None, own)  # auto runs cudnn there: not repeated
    assert [kernel for _, kernel in rows] == ["dense", "blockwise"]
    assert all(par == bf16.parallel for par, _ in rows)
    cpu = DeviceSet(devices=(object(),), platform="cpu", simulated=True, kind="cpu")
    with pytest.raises(ConfigError, match="needs an NVIDIA GPU"):
        bench.attention_rows(bf16, cpu, "cudnn", own)
    with pytest.raises(ConfigError, match="lower train.global_batch_size"):
        measure(cfg, own[:1], jax.devices(), limit=1.0, log=lambda *_: None)


@pytest.mark.slow
def test_one_runner_at_a_time_as_on_an_accelerator(cfg):
    one = bench.layouts_for(cfg, [], False)[:1]
    found = measure(cfg, one, jax.devices(), Timing(steps=2, rounds=1, warmup=1),
                    log=lambda *_: None, resident=False)
    assert found.pairs == [] and len(found.rows) == 1 and len(found.ref.times) == 2
    line = headline(reference_ratio(found), found.pairs)
    assert "ratio of median step times" in line and "nan" not in line


def test_mock_gpu_reads_settings_between_its_options():
    from tools import mock_gpu

    args = mock_gpu._parser().parse_intermixed_args(
        ["recipe=llama_1b_8gpu", "--schedules", "gpipe,1f1b", "parallel.remat=none",
         "--steps", "2"])
    assert args.overrides == ["recipe=llama_1b_8gpu", "parallel.remat=none"]
    assert args.schedules == "gpipe,1f1b" and args.steps == 2


@pytest.mark.slow
def test_mock_gpu_measures_a_schedule_on_the_devices_here(cfg):
    """tools/mock_gpu.py's measurement on the simulated CPU devices (`--no-mock`): a
    step time, the compiled memory, no MFU without a known peak."""
    from framework.engine.validate import validate
    from framework.runtime.devices import DeviceSet
    from tools import mock_gpu

    par = dataclasses.replace(cfg.parallel, pipeline=2, data=2, tensor=1, microbatches=2,
                              schedule="1f1b")
    par = validate(cfg.model, par, cfg.train, par.n_devices)
    found = tuple(jax.devices()[:par.n_devices])
    devset = DeviceSet(found, "cpu", True, found[0].device_kind, 0, 1)
    row = mock_gpu.measure(cfg, par, devset, steps=1)
    assert row["step_s"] > 0 and row["memory_gib"] > 0 and row["mfu"] is None
    assert row["mesh"].startswith("pp2-dp2-tp1")


def test_mock_gpu_puts_this_gpu_at_the_stage_asked_for():
    from framework.config import ParallelConfig
    from framework.errors import ConfigError
    from tools import mock_gpu

    par = ParallelConfig(pipeline=4, data=2, tensor=2)
    devices = [f"d{i}" for i in range(16)]
    for stage in range(4):
        grid = mock_gpu.stage_grid(par, devices, "d0", stage)
        assert grid.shape == (4, 2, 1, 2) and grid[stage, 0, 0, 0] == "d0"
        assert sorted(grid.ravel().tolist()) == sorted(devices)
    assert mock_gpu.stages_of("last", 4) == [3] and mock_gpu.stages_of("all", 2) == [0, 1]
    with pytest.raises(ConfigError, match="--stage '4'"):
        mock_gpu.stages_of("4", 4)


def test_mock_gpu_schedules_run_combined_as_asked_or_where_they_can():
    """--schedules name[:v][/combined|/separate]: combined cells as asked; without, the
    recipe's combined_1f1b is kept where the table can run it (a zero-bubble schedule
    cannot: its B and W are separate cells)."""
    from framework.config import ParallelConfig
    from framework.errors import ConfigError
    from tools import mock_gpu

    par = ParallelConfig(pipeline=2, microbatches=4, schedule="interleaved_1f1b",
                         virtual_stages=2, combined_1f1b=True)
    assert mock_gpu.with_schedule(par, "1f1b").combined_1f1b
    assert not mock_gpu.with_schedule(par, "zb_h1").combined_1f1b
    assert not mock_gpu.with_schedule(par, "interleaved_1f1b:2/separate").combined_1f1b
    off = mock_gpu.with_schedule(dataclasses.replace(par, combined_1f1b=False), "1f1b/combined")
    assert off.combined_1f1b and off.virtual_stages == 1
    with pytest.raises(ConfigError, match="/combined"):
        mock_gpu.with_schedule(par, "1f1b/fused")


@pytest.mark.slow
def test_a_runner_out_of_device_memory_is_skipped_and_the_rows_before_it_kept(
        cfg, monkeypatch):
    """On an accelerator the reference (whose memory nothing predicts: whole logits) may
    not fit where the framework's chunked loss does: its row is a skipped line and the
    framework's rows, timed before it, are still reported."""
    from tools import bench_measure

    class OutOfMemory(RuntimeError):
        pass

    def exhausted(*args, **kwargs):
        raise OutOfMemory("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                          "75.20GiB.\nmore")

    monkeypatch.setattr(bench_measure, "_ReferenceRunner", exhausted)
    one = bench.layouts_for(cfg, [], False)[:1]
    skipped = []
    found = measure(cfg, one, jax.devices(), Timing(steps=2, rounds=1, warmup=1),
                    log=lambda *_: None, skipped=skipped, resident=False)
    assert len(found.rows[0].times) == 2 and found.ref.times == []
    assert len(skipped) == 1 and "out of device memory" in skipped[0] and "75.20GiB" in skipped[0]
    assert "No framework (1,1,1) / reference ratio" in headline(reference_ratio(found), [])
    rows = table(cfg, found.rows, found.ref, 1e12, True, False)
    assert len(rows) == 3 and "| – |" in rows[2] and REFERENCE not in "".join(rows)

    monkeypatch.setattr(bench_measure, "_ReferenceRunner",
                        lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):  # anything else is not swallowed
        measure(cfg, one, jax.devices(), Timing(steps=1, rounds=1, warmup=0),
                log=lambda *_: None, resident=False)
