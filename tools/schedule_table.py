"""Every pipeline schedule side by side: bubble (closed form, table, timed on the
devices), per-device memory, pipe bytes and step time.

    python tools/schedule_table.py --pipeline 4 --microbatches 8
    python tools/schedule_table.py --pipeline 4 --microbatches 4 8 16 --no-run   # memory only
    python tools/schedule_table.py --pipeline 4 --microbatches 8 --gpipe-ticks
    python tools/schedule_table.py --pipeline 4 --microbatches 8 --sends overlapped synchronous

For each schedule (and each microbatch count, at a fixed microbatch size, so the global
batch grows with it) it compiles the train step on simulated CPU devices and prints a
Markdown row: the bubble from the paper's formula, from the table in lockstep unit-cost
ticks (`Schedule.bubble_fraction`) and, unless --no-run, timed from a profile of the
running step (`framework/analysis/profiling.py`); XLA's memory analysis per device (temp /
peak); bytes each device sends over `pipe` per step (the communication audit); the
median step time. --gpipe-ticks adds GPipe's order run by the tick executor (backward
included) instead of by autodiff, to compare the two executors on one table; --sends
runs the tick schedules with overlapped sends, synchronous ones, or both
(`parallel.overlap_sends`; GPipe and circular send synchronously either way).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.runtime.quiet import import_jax  # noqa: E402

import_jax()  # before anything imports JAX: its plugins' start-up lines stay off stderr


def gpipe_ticks(p: int, m: int, v: int, overlap: bool = False):
    """GPipe's table (all forwards, then all backwards) for the tick executor."""
    from framework.parallel.pipeline import schedule as s

    programs = [[(s.F, i, 0) for i in range(m)] + [(s.BW, i, 0) for i in range(m)]
                for _ in range(p)]
    return s.simulate("gpipe_ticks", m, programs, (p - 1) / (m + p - 1),
                      s.Clock.of(p, overlap=overlap))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--microbatch-rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--schedules", nargs="+", default=None,
                        help="default: every registered schedule")
    parser.add_argument("--virtual-stages", type=int, default=2)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--no-run", action="store_true", help="compile only: no timings")
    parser.add_argument("--gpipe-ticks", action="store_true")
    parser.add_argument("--sends", nargs="+", choices=("overlapped", "synchronous"),
                        default=["overlapped"])
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import jax

    from framework.config import DevicesConfig, ModelConfig, ParallelConfig, TrainConfig
    from framework.model.llama import init_params
    from framework.model.reference import tokens_for_step
    from framework.parallel.pipeline import schedule as schedules
    from framework.runtime import devices

    devices.start(DevicesConfig(platform="cpu", local_device_count=args.pipeline),
                  ParallelConfig(pipeline=args.pipeline))
    names = list(args.schedules or schedules.schedule_names())
    if args.gpipe_ticks:
        schedules.register("gpipe_ticks")(gpipe_ticks)
        names.append("gpipe_ticks")
    model = ModelConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers,
                        n_heads=8, n_kv_heads=4, d_ff=4 * args.d_model)
    params = jax.jit(lambda k: init_params(model, k))(jax.random.key(0))
    print(f"pipeline={args.pipeline}, {args.microbatch_rows} rows x {args.seq_len} tokens per "
          f"microbatch, d_model {args.d_model}, {args.layers} layers, remat {args.remat}, "
          f"{jax.devices()[0].device_kind} ({args.pipeline} simulated devices)")
    print("| schedule | microbatches | bubble: formula | table | timed | temp / peak MiB "
          "per device | pipe MB per step | step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for m in args.microbatches:
        train = TrainConfig(seq_len=args.seq_len, global_batch_size=m * args.microbatch_rows)
        tokens = tokens_for_step(0, 0, train.global_batch_size, train.seq_len, model.vocab_size)
        for name in names:
            v = args.virtual_stages if schedules.uses_virtual_stages(name) else 1
            ticks = not schedules.check(name, args.pipeline, m, v) and schedules.make_schedule(
                name, args.pipeline, m, v).executor == "ticks"
            for sends in args.sends if ticks else args.sends[:1]:
                print(_row(args, model, train, params, tokens, name, m, sends == "overlapped"),
                      flush=True)
    return 0


def _row(args, model, train, params, tokens, name: str, m: int, overlap: bool) -> str:
    """One schedule at m microbatches: compiled (memory, pipe bytes) and, unless
    --no-run, timed (step time, timed bubble)."""
    from framework.analysis import audit
    from framework.config import OptimConfig, ParallelConfig
    from framework.engine.build import build_engine
    from framework.engine.validate import validate
    from framework.parallel.mesh import make_mesh
    from framework.parallel.pipeline import schedule as schedules

    v = args.virtual_stages if schedules.uses_virtual_stages(name) else 1
    problems = schedules.check(name, args.pipeline, m, v)
    if problems:
        return f"| {name} | {m} | not valid: {'; '.join(problems)} |"
    par = ParallelConfig(pipeline=args.pipeline, microbatches=m, schedule=name,
                         virtual_stages=v, remat=args.remat, overlap_sends=overlap)
    par = validate(model, par, train, args.pipeline)
    engine = build_engine(model, par, OptimConfig(), 10, make_mesh(par))
    state, batch = engine.init_state(params), engine.shard_batch(tokens)
    stats = audit.step_stats(engine, state, batch)
    timed, step_ms = ("-", "-") if args.no_run else _timed(engine, state, batch, args.steps)
    label = name + (f" (v={v})" if v > 1 else "") + (
        "" if engine.schedule.executor != "ticks" else
        ", overlapped" if engine.schedule.overlap else ", synchronous")
    return (f"| {label} | {m} | {engine.schedule.formula_bubble:.1%} | "
            f"{engine.schedule.bubble_fraction:.1%} | {timed} | "
            f"{stats['memory/temp_bytes_per_device'] / 2**20:.2f} / "
            f"{stats['memory/peak_bytes_per_device'] / 2**20:.2f} | "
            f"{stats['comm/bytes_per_step/pipe'] / 1e6:.2f} | {step_ms} |")


def _timed(engine, state, batch, steps: int) -> tuple[str, str]:
    """(the timed bubble of two profiled steps, the median step time in ms)."""
    import jax

    from framework.analysis import profiling

    state, metrics = engine.step(state, batch)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = engine.step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    box = {"state": state}

    def two_steps():
        for _ in range(2):
            box["state"], out = engine.step(box["state"], batch)
        jax.block_until_ready(out)

    with tempfile.TemporaryDirectory() as folder:
        found = profiling.measure(engine, two_steps, Path(folder))
    return f"{found['pipeline/bubble_fraction_timed']:.1%}", f"{1e3 * statistics.median(times):.1f}"


if __name__ == "__main__":
    sys.exit(main())
