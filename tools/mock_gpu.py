"""One device's share of a multi-GPU program, timed on one GPU: JAX's mock GPU topology.

    python tools/mock_gpu.py recipe=llama_1b_8gpu --schedules gpipe,1f1b,zb_h1 --steps 5

With `jax_mock_gpu_topology` = one slice of (devices the recipe's mesh needs) / (GPUs
here) hosts, JAX's GPU client pretends to be one process of a cluster of identical GPUs:
`jax.devices()` lists them all, the program is compiled for the whole mesh and this GPU
runs its own device's part, with every collective replaced by a no-op (XLA's mock
NCCL). What it measures is each schedule's per-device computation, bubbles included,
without any communication time, of one pipeline stage (`--stage`, default the last: it
holds the head; the mesh's devices are placed so that this GPU holds it): a lower bound
of that stage's step time on the real cluster, whose step waits for its slowest stage.
Needs an NVIDIA GPU of the target model. Per schedule it prints the compile time, the compiled memory per device
(XLA's memory analysis on the real GPU) and the median step time, with model TFLOP/s
per device and MFU against the GPU's peak (framework/hardware.py).
`--no-mock` runs the same on the devices a run would get (simulated CPU devices: for
trying the tool itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.analysis.device_time import ungraphed  # noqa: E402
from framework.runtime.quiet import NOISE, filtered_stderr, import_jax  # noqa: E402

UNGRAPHED = ungraphed(sys.argv)  # --profile: CUDA graphs off (its note, else "")
import_jax()  # before anything imports JAX: its plugins' start-up lines stay off stderr

from tools.recipe import compose, user_error  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="recipe=<name> and key=value overrides")
    parser.add_argument("--schedules", default="",
                        help="comma-separated, each name[:virtual stages][/combined|"
                             "/separate] (e.g. 1f1b,interleaved_1f1b:2/combined,zb_v; "
                             "default: the recipe's)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per schedule")
    parser.add_argument("--no-mock", action="store_true", help="the run's own devices")
    parser.add_argument("--stage", default="last",
                        help="the pipeline stage this GPU runs: first, last, all (one row "
                             "each) or a number (mocked runs; default last: the head's)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--profile", action="store_true",
                        help="also profile each row's step: device time per kind of kernel, "
                             "kernels per step, the top ops")
    return parser


def _inputs(engine, cfg):
    """A fresh train state and a random batch, made on the devices (each process makes
    its own shards; nothing crosses the host)."""
    import jax

    from framework.engine.state import as_dtype, new_state
    from framework.model.llama import init_params
    from framework.parallel.pipeline.layout import canonical_to_train

    split = lambda p: canonical_to_train(p, engine.parallel.pipeline, engine.n_chunks,
                                         engine.layout.v_shape)
    make = lambda key: new_state(as_dtype(split(init_params(cfg.model, key)),
                                          engine.layout.param_dtype), engine.optimizer)
    state = jax.jit(make, out_shardings=engine.state_shardings)(jax.random.key(0))
    shape = (cfg.train.global_batch_size, cfg.train.seq_len + 1)
    tokens = jax.jit(lambda k: jax.random.randint(k, shape, 0, cfg.model.vocab_size),
                     out_shardings=engine.batch_sharding())(jax.random.key(1))
    return state, tokens


def stage_grid(parallel, devices: list, here, stage: int):
    """The mesh's devices [pipe, data, context, tensor] with `here` (the one GPU that
    runs) at pipeline stage `stage`: a mocked run computes only its own device's part,
    and stages differ (the last holds the head, the first the embedding)."""
    import numpy as np

    from framework.parallel.mesh import degrees

    shape = tuple(degrees(parallel).values())
    others = [d for d in devices if d != here][:parallel.n_devices - 1]
    at = stage * (parallel.data * parallel.context * parallel.tensor)  # (stage, 0, 0, 0)
    order = others[:at] + [here] + others[at:]
    grid = np.empty(len(order), dtype=object)
    grid[:] = order
    return grid.reshape(shape)


def measure(cfg, parallel, devset, steps: int, stage: int | None = None,
            profile: bool = False) -> dict:
    """One schedule's step, compiled for the whole mesh; `stage`: the pipeline stage
    this process's GPU holds (mocked runs; None: the devices in their own order);
    `profile`: also where its device time goes (`row["profile"]`)."""
    import jax
    from jax.sharding import AxisType

    from framework import hardware
    from framework.analysis import audit
    from framework.model.flops import model_flops_per_token
    from framework.engine.build import build_engine
    from framework.parallel.mesh import make_mesh, mesh_axes, mesh_name

    if stage is None:
        mesh = make_mesh(parallel, devset.devices)
    else:
        grid = stage_grid(parallel, list(devset.devices), jax.local_devices()[0], stage)
        axes = mesh_axes(parallel)  # with `expert` under expert parallelism
        mesh = jax.sharding.Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))
    engine = build_engine(cfg.model, parallel, cfg.optim, cfg.train.steps, mesh)
    state, tokens = _inputs(engine, cfg)
    stats = audit.step_stats(engine, state, tokens)
    times = []
    for i in range(steps + 2):  # two untimed steps first
        start = time.perf_counter()
        state, metrics = engine.step(state, tokens)
        jax.block_until_ready((state, metrics))
        if i >= 2:
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    found = _profile(engine, state, tokens) if profile else None
    model_flops = (model_flops_per_token(cfg.model, cfg.train.seq_len)
                   * cfg.train.global_batch_size * cfg.train.seq_len / len(devset))
    peak = hardware.peak_flops(devset.kind, cfg.model.dtype)
    return {"mesh": mesh_name(parallel), "schedule": parallel.schedule, "stage": stage,
            "compile_s": stats["perf/compile_time_s"],
            "memory_gib": stats.get("memory/peak_bytes_per_device", 0) / 2**30,
            "step_s": step, "steps": times, "tflops_per_device": model_flops / step / 1e12,
            "mfu": model_flops / step / peak if peak else None,
            "profile": None if found is None else {
                "seconds": found.seconds, "kernels": found.kernels, "top": found.top,
                "lines": found.lines()}}


def _profile(engine, state, tokens, steps: int = 2):
    """The step's device time by kind of kernel (framework/analysis/device_time.py)."""
    import tempfile

    import jax

    from framework.analysis import device_time

    held = [state]

    def one():
        held[0], metrics = engine.step(held[0], tokens)
        jax.block_until_ready((held[0], metrics))

    with tempfile.TemporaryDirectory() as folder:
        return device_time.profile_steps(one, steps, folder, engine.compiled.as_text())


# What XLA:GPU logs compiling for the mock topology, three times a row (its devices'
# assignment is not an iota; harmless: the program compiles and runs)
MOCK_NOISE = ("only supports IOTA device assignment",)
CELLS = {"combined": True, "separate": False}  # --schedules name/cells: combined_1f1b


def with_schedule(parallel, spec: str):
    """`parallel` running `name[:virtual stages][/combined|/separate]` (a schedule
    without virtual stages runs with 1; with them, the given count or the layout's own;
    `parallel.combined_1f1b` as given, else the layout's where the table can run it)."""
    from framework.engine.validate import combined_where_possible
    from framework.errors import ConfigError
    from framework.parallel.pipeline.schedule import uses_virtual_stages

    given, _, cells = spec.partition("/")
    name, _, v = given.partition(":")
    if (v and not v.isdigit()) or (cells and cells not in CELLS):
        raise ConfigError(f"--schedules {spec!r}: name[:virtual stages][/combined|/separate], "
                          f"e.g. interleaved_1f1b:2/combined")
    virtual = int(v) if v else (parallel.virtual_stages if uses_virtual_stages(name) else 1)
    out = dataclasses.replace(parallel, schedule=name, virtual_stages=virtual)
    if cells:
        return dataclasses.replace(out, combined_1f1b=CELLS[cells])
    return combined_where_possible(out)


def stages_of(spec: str, pipeline: int) -> list[int]:
    """--stage: first, last, all or a stage number -> the stages to measure."""
    from framework.errors import ConfigError

    named = {"first": [0], "last": [pipeline - 1], "all": list(range(pipeline))}
    if spec in named:
        return named[spec]
    if spec.isdigit() and int(spec) < pipeline:
        return [int(spec)]
    raise ConfigError(f"--stage {spec!r}: first, last, all or a stage number below "
                      f"parallel.pipeline={pipeline}")


def main(argv=None) -> int:
    args = _parser().parse_intermixed_args(argv)
    from framework.engine.validate import validate
    from framework.errors import ConfigError
    from framework.runtime import devices

    import jax

    try:
        cfg = compose(args.overrides)
        par = cfg.parallel
        wanted = par.pipeline * par.data * par.context * par.tensor
        stages = [None] if args.no_mock else stages_of(args.stage, par.pipeline)
        if not args.no_mock:
            local = 1  # GPUs here; the mesh's other devices are mocked
            # one slice of `wanted` one-GPU hosts (mock processes without a topology are
            # each a slice of their own, which jax.make_mesh refuses)
            jax.config.update("jax_mock_gpu_topology", f"1x{max(1, wanted // local)}x{local}")
            # autotuning results are shared among the processes: the mocked ones never answer
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                       + " --xla_gpu_shard_autotuning=false").strip()
        devset = devices.start(cfg.devices, cfg.parallel)
        layouts = [validate(cfg.model, with_schedule(cfg.parallel, s), cfg.train, len(devset))
                   for s in [s for s in args.schedules.split(",") if s]
                   or [cfg.parallel.schedule]]
    except ConfigError as err:
        return user_error(err)
    print(f"{len(devset)} x {devset.kind} ({jax.local_device_count()} here)", flush=True)
    if UNGRAPHED:
        print(UNGRAPHED, flush=True)
    rows = []
    for parallel, stage in [(par, st) for par in layouts for st in stages]:
        with filtered_stderr(NOISE + MOCK_NOISE):  # (other lines pass, after the row)
            row = measure(cfg, parallel, devset, args.steps, stage, args.profile)
        row["combined_1f1b"] = parallel.combined_1f1b
        rows.append(row)
        mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
        where = (" combined" if parallel.combined_1f1b else "") + (
            "" if stage is None else f" stage {stage}")
        print(f"{row['mesh'] + where:<36} compile {row['compile_s']:6.1f} s  memory "
              f"{row['memory_gib']:6.2f} GiB  step {row['step_s'] * 1e3:9.1f} ms  "
              f"{row['tflops_per_device']:7.1f} TFLOP/s/device  MFU {mfu}", flush=True)
        for line in (row["profile"] or {}).get("lines", []):
            print("    " + line, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": devset.kind, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
