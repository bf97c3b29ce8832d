"""Steady-state speed of the framework against the plain JAX step, layout by layout.

    python tools/bench.py recipe=llama_small_3d
    python tools/bench.py recipe=llama_small_3d parallel.tensor=2 \\
        --layout 4,2,1:microbatches=8:schedule=1f1b
    python tools/bench.py recipe=llama_tiny_debug --steps 3 --rounds 2 --markdown bench.md
    python tools/bench.py recipe=llama_1b_1gpu devices.platform=gpu

For each layout (default: 1,1,1 2,1,1 1,2,1 1,1,2 2,2,2, the recipe's own, then every
`--layout P,D,T[:field=value...]`) it compiles the engine's step once (compilation
excluded from every timing) and, in the same process, the naive single-device
reference step (`framework/model/reference.py`). Timing survives a noisy shared machine:
every runner gets `--rounds` blocks of `--steps` individually timed steps, the blocks
of all runners interleaved (in a shuffled order per round) after one untimed step, and
the table quotes medians. The framework/reference ratio at (1,1,1) is the median over
`--pairs` back-to-back pairs of one framework and one reference step (which one goes
first alternates): on a machine whose load changes from second to second, only
neighbouring steps see the same machine.

MFU: on accelerators against the peak table (`framework/analysis/flops.py`); on CPU against
the host's float32 matmul peak, measured once here (simulated devices share the host's
cores, so there their rows show the parallel program's overhead, never a speed-up).
Compile time: the step of the recipe's model traced and compiled with 4 and with 32
layers, at (1,1,1) and at the recipe's layout (layers are scanned, so 32 layers should
cost at most 1.5x what 4 cost); on CPU by default (`--compile-reps`).

Attention: `--attention dense,blockwise,cudnn` (the default on GPUs) adds a row per
kernel at the recipe's layout (`model.attention`; the first rows run `auto`). Before a
row is built its memory is predicted (`framework/analysis/memory_model.py`) and checked against
the device's limit (`framework/analysis/memory_check.py`): a row that would not fit is reported
as skipped, with its prediction, instead of failing. On CPU the laptop row (`--laptop`,
the default there): 4 layers, d_model 128, seq 64, batch 12 at (1,1,1) and its plain JAX
reference, the shape of the issue's PyTorch comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import random
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from framework.runtime.quiet import import_jax  # noqa: E402

import_jax()  # before anything imports JAX: its plugins' start-up lines stay off stderr

from tools.recipe import compose, user_error  # noqa: E402
from framework.analysis import audit  # noqa: E402
from framework.parallel.mesh import mesh_name  # noqa: E402

DEFAULT_LAYOUTS = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2))
SIMULATED_NOTE = ", simulated: rows on several devices show overhead, not speed-up"
LAPTOP = {"seq_len": 64, "global_batch_size": 12}  # with ModelConfig()'s 4 x d_model 128


@dataclass
class Row:
    name: str
    parallel: object  # ParallelConfig, or None for the reference
    n_devices: int
    times: list = field(default_factory=list)  # seconds per step, every timed step
    rounds: list = field(default_factory=list)  # median of each round's block
    compile_s: float = float("nan")
    peak_bytes: float = float("nan")  # XLA's memory analysis, per device
    predicted_bytes: float = float("nan")  # framework/analysis/memory_model.py

    @property
    def step_s(self) -> float:
        return statistics.median(self.times)


def parse_layout(spec: str, base):
    """'P,D,T[:field=value...]' -> ParallelConfig on top of `base` (microbatches and
    schedule reset to 1 / gpipe unless given: pipeline > 1 keeps the base's)."""
    from framework.errors import ConfigError
    from framework.config import ParallelConfig

    degrees, *extras = spec.split(":")
    try:
        p, d, t = (int(x) for x in degrees.split(","))
    except ValueError:
        raise ConfigError(f"--layout {spec!r}: expected P,D,T[:field=value...]") from None
    par = dataclasses.replace(base, pipeline=p, data=d, tensor=t)
    if p == 1:
        par = dataclasses.replace(par, microbatches=1, schedule="gpipe", virtual_stages=1)
    types = {f.name: type(getattr(ParallelConfig(), f.name))
             for f in dataclasses.fields(ParallelConfig)}
    for extra in extras:
        key, _, value = extra.partition("=")
        if key not in types:
            raise ConfigError(f"--layout {spec!r}: {key!r} is not a parallel.* field")
        kind = types[key]
        par = dataclasses.replace(par, **{key: value.lower() in ("1", "true", "yes") if kind is bool
                                          else kind(value)})
    return par


def layouts_for(cfg, specs: list[str], defaults: bool) -> list:
    """(1,1,1) with the reference's own settings first (no remat, one microbatch: the
    ratio compares like with like), then the other default layouts, the recipe's own,
    and the command line's; duplicates dropped."""
    base = cfg.parallel
    one = dataclasses.replace(base, pipeline=1, data=1, tensor=1, microbatches=1,
                              schedule="gpipe", virtual_stages=1, remat="none", zero1=False,
                              sequence_parallel=False)
    found = [one]
    if defaults:
        found += [parse_layout(",".join(map(str, d)), base) for d in DEFAULT_LAYOUTS[1:]]
    found.append(base)
    found += [parse_layout(s, base) for s in specs]
    unique = []
    for par in found:
        if par not in unique:
            unique.append(par)
    return unique


def host_matmul_peak(device, n: int = 2048, reps: int = 7) -> float:
    """FLOP/s of one float32 n x n matmul on `device` (median of reps)."""
    import jax
    import jax.numpy as jnp

    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, a).block_until_ready()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mm(a, a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


class _EngineRunner:
    def __init__(self, cfg, par, devices, params, tokens, model=None):
        from framework.engine.build import build_engine
        from framework.parallel.mesh import make_mesh
        from framework.analysis.memory_model import predict_memory

        model = model or cfg.model
        self.engine = build_engine(model, par, cfg.optim, cfg.train.steps,
                                   make_mesh(par, devices))
        self.state = self.engine.init_state(params)
        self.tokens = self.engine.shard_batch(tokens)
        stats = audit.step_stats(self.engine, self.state, self.tokens)
        self.compile_s = stats["perf/compile_time_s"]
        self.peak_bytes = stats.get("memory/peak_bytes_per_device", float("nan"))
        self.predicted_bytes = predict_memory(model, par, cfg.train)["total"]

    def step(self):
        self.state, metrics = self.engine.step(self.state, self.tokens)
        return metrics["train/loss"]


class _ReferenceRunner:
    def __init__(self, cfg, device, params, tokens):
        import jax

        from framework.model import reference
        from framework.engine.optim import make_optimizer

        optimizer = make_optimizer(cfg.optim, cfg.train.steps)
        # Parameters and optimizer state donated, as the engine's step does: on a GPU the
        # 1B model's state must not be held twice.
        self.fn = jax.jit(reference.reference_train_step(cfg.model, optimizer),
                          donate_argnums=(0, 1))
        self.params = jax.device_put(params, device)
        self.opt_state = jax.jit(optimizer.init)(self.params)
        self.tokens = jax.device_put(tokens, device)
        start = time.perf_counter()
        self.fn = self.fn.lower(self.params, self.opt_state, self.tokens).compile()
        self.compile_s = time.perf_counter() - start

    def step(self):
        self.params, self.opt_state, loss = self.fn(self.params, self.opt_state, self.tokens)
        return loss


def _timed_step(runner) -> float:
    start = time.perf_counter()
    runner.step().block_until_ready()  # one executable: its outputs are ready together
    return time.perf_counter() - start


def _variant(cfg, layout):
    """A layout is a ParallelConfig, or (ParallelConfig, model.attention) for a row of
    another attention kernel: (row name, parallel, model)."""
    par, attention = layout if isinstance(layout, tuple) else (layout, None)
    if attention is None:
        return mesh_name(par), par, cfg.model
    return (f"{mesh_name(par)} attention={attention}", par,
            dataclasses.replace(cfg.model, attention=attention))


def measure(cfg, layouts: list, devices, steps: int = 5, rounds: int = 3, warmup: int = 2,
            pairs: int = 20, seed: int = 0, log=print, limit: float | None = None,
            skipped: list | None = None, resident: bool = True) -> tuple[list[Row], Row, list]:
    """Times every layout and the reference, interleaved. Returns (rows, reference row,
    pairs): `pairs` more steps of the first layout and of the reference run back to
    back (alternating which goes first), [(framework s, reference s), ...]: on a shared
    machine whose load changes by the second, neighbouring steps see the same load.
    Layouts after the first predicted over `limit` bytes per device are left out (a
    line in `skipped`); the first (the reference's shape) must fit. With `resident`
    false (accelerators: a dedicated device, whose memory holds one large model's state
    at a time) each runner is built, timed and freed in turn, and there are no pairs."""
    import jax

    from framework.model.llama import init_params
    from framework.model.reference import tokens_for_step

    params = jax.jit(lambda key: init_params(cfg.model, key))(jax.random.key(cfg.train.seed))
    if not resident:
        params = jax.device_get(params)  # the host keeps the initial parameters
    tokens = tokens_for_step(cfg.train.seed, 0, cfg.train.global_batch_size,
                             cfg.train.seq_len, cfg.model.vocab_size)
    fitting = _fitting(cfg, layouts, limit, log, skipped)
    runners, rows = [], []
    for name, par, model in fitting + [("reference (plain JAX)", None, None)]:
        runner, row = _runner(cfg, name, par, model, devices, params, tokens)
        rows.append(row)
        log(f"compiled {name} in {runner.compile_s:.1f}s")
        if resident:
            runners.append(runner)
            continue
        _time_alone(runner, row, steps, rounds, warmup)
        del runner  # frees its state before the next runner allocates its own
    if not resident:
        return rows[:-1], rows[-1], []
    _time_interleaved(runners, rows, steps, rounds, warmup, seed, log)
    return rows[:-1], rows[-1], _paired(runners[0], runners[-1], pairs)


def _fitting(cfg, layouts, limit, log, skipped) -> list:
    """(name, parallel, model) of the layouts predicted to fit `limit` (bytes/device)."""
    from framework.analysis.memory_model import predict_memory

    fitting = []
    for i, layout in enumerate(layouts):
        name, par, model = _variant(cfg, layout)
        need = predict_memory(model, par, cfg.train)["total"] if limit else 0
        if limit and need > limit:
            line = (f"{name}: predicted {need / 2**30:.2f} GiB per device, over the "
                    f"{limit / 2**30:.2f} GiB limit: not run")
            if i == 0:
                from framework.errors import ConfigError

                raise ConfigError(f"{line} (it is the reference's shape: lower "
                                  f"train.global_batch_size)")
            log(f"skipped {line}")
            (skipped if skipped is not None else []).append(line)
            continue
        fitting.append((name, par, model))
    return fitting


def _runner(cfg, name, par, model, devices, params, tokens):
    """(runner, its row): the reference's for `par` None, else the framework's."""
    if par is None:
        runner = _ReferenceRunner(cfg, devices[0], params, tokens)
        return runner, Row(name, None, 1, compile_s=runner.compile_s)
    runner = _EngineRunner(cfg, par, devices, params, tokens, model)
    return runner, Row(name, par, par.n_devices, compile_s=runner.compile_s,
                       peak_bytes=runner.peak_bytes, predicted_bytes=runner.predicted_bytes)


def _time_alone(runner, row: Row, steps: int, rounds: int, warmup: int) -> None:
    for _ in range(warmup):
        runner.step().block_until_ready()
    for _ in range(rounds):
        block = [_timed_step(runner) for _ in range(steps)]
        row.times += block
        row.rounds.append(statistics.median(block))


def _time_interleaved(runners, rows, steps: int, rounds: int, warmup: int, seed: int,
                      log) -> None:
    """Every round, each runner's block of steps, in a shuffled order per round."""
    for runner in runners:
        for _ in range(warmup):
            runner.step().block_until_ready()
    order = list(range(len(runners)))
    shuffle = random.Random(seed)
    for r in range(rounds):
        shuffle.shuffle(order)
        for i in order:
            _timed_step(runners[i])  # untimed: the previous runner's caches, allocation
            block = [_timed_step(runners[i]) for _ in range(steps)]
            rows[i].times += block
            rows[i].rounds.append(statistics.median(block))
        log(f"round {r + 1}/{rounds} done")


def _paired(framework_runner, ref, pairs: int) -> list:
    """[(framework s, reference s), ...]: back-to-back steps, alternating which first."""
    paired = []
    for k in range(pairs):
        first, second = (framework_runner, ref) if k % 2 == 0 else (ref, framework_runner)
        a, b = _timed_step(first), _timed_step(second)
        paired.append((a, b) if k % 2 == 0 else (b, a))
    return paired


def reference_ratio(rows: list[Row], ref: Row, pairs: list) -> dict:
    """Framework (1,1,1) (the first row, see `layouts_for`) / reference, four ways: the
    median of back-to-back step pairs (the headline: robust to load changing over
    time), the median of per-round ratios, the ratio of medians and of minima."""
    one = rows[0]
    per_round = [a / b for a, b in zip(one.rounds, ref.rounds)]
    per_pair = [a / b for a, b in pairs]
    return {"paired": statistics.median(per_pair) if pairs else float("nan"),
            "pairs": per_pair,
            "median_of_rounds": statistics.median(per_round), "rounds": per_round,
            "of_medians": one.step_s / ref.step_s, "of_minima": min(one.times) / min(ref.times)}


def compile_times(cfg, par, devices, layers=(4, 32), reps: int = 3) -> dict[int, list[float]]:
    """Seconds to trace + compile the step for each layer count (never run: abstract
    inputs), repetitions interleaved, each with a fresh engine."""
    from framework.engine.build import build_engine
    from framework.parallel.mesh import make_mesh

    out = {n: [] for n in layers}
    for _ in range(reps):
        for n in layers:
            model = dataclasses.replace(cfg.model, n_layers=n)
            eng = build_engine(model, par, cfg.optim, cfg.train.steps, make_mesh(par, devices))
            inputs = eng.abstract_inputs(cfg.train.global_batch_size, cfg.train.seq_len)
            out[n].append(eng.compile(*inputs))
    return out


def table(cfg, rows: list[Row], ref: Row, peak_flops: float, per_device_peak: bool,
          simulated: bool) -> list[str]:
    """Markdown rows: one per layout, then the reference."""
    from framework.analysis.flops import flops_per_token

    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    per_token = flops_per_token(cfg.model, cfg.train.seq_len)
    out = ["| layout | devices | step ms (median) | min–max ms | tokens/s | model TFLOP/s | MFU "
           "| vs reference | compile s | peak MiB/device (XLA) | planner MiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows + [ref]:
        rate = tokens / row.step_s
        achieved = per_token * rate
        peak = peak_flops * (row.n_devices if per_device_peak else 1)
        kind = " (simulated)" if simulated and row.n_devices > 1 else ""
        mib = lambda b: "–" if b != b else f"{b / 2**20:.0f}"
        out.append(
            f"| {row.name}{'' if row.parallel is None else _extras(row.parallel)} "
            f"| {row.n_devices}{kind} | {row.step_s * 1e3:.1f} "
            f"| {min(row.times) * 1e3:.0f}–{max(row.times) * 1e3:.0f} | {rate:,.0f} "
            f"| {achieved / 1e12:.3f} | {achieved / peak:.1%} | {row.step_s / ref.step_s:.3f} "
            f"| {row.compile_s:.1f} | {mib(row.peak_bytes)} | {mib(row.predicted_bytes)} |")
    return out


def _extras(par) -> str:
    parts = [k for k, on in (("zero1", par.zero1), ("sp", par.sequence_parallel)) if on]
    if par.remat != "none":
        parts.append(f"remat={par.remat}")
    return f" ({', '.join(parts)})" if parts else ""


def _runs(cfg, devset) -> str:
    """The attention kernel the recipe's model runs on this platform."""
    from framework.model.attention import choose

    m = cfg.model
    return m.attention if m.attention != "auto" else choose(devset.platform, m.dtype,
                                                           cfg.train.seq_len, m.head_dim)


def _resolved(cfg, devset) -> str:
    return f" (runs {_runs(cfg, devset)})" if cfg.model.attention == "auto" else ""


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def laptop_lines(row: Row, ref: Row, pairs: list) -> list[str]:
    """The laptop row's summary: tokens/s of the framework at (1,1,1) and of plain JAX."""
    tokens = LAPTOP["seq_len"] * LAPTOP["global_batch_size"]
    ratio = reference_ratio([row], ref, pairs)["paired"]
    return [f"**Laptop shape** (4 layers, d_model 128, seq {LAPTOP['seq_len']}, batch "
                f"{LAPTOP['global_batch_size']}, float32) at (1,1,1): framework "
                f"{tokens / row.step_s:,.0f} tokens/s (median step {row.step_s * 1e3:.1f} ms), "
                f"plain JAX {tokens / ref.step_s:,.0f} tokens/s; framework/reference "
                f"{ratio:.3f} (median of {len(pairs)} back-to-back pairs)."]


def headline(ratio: dict, pairs: list) -> str:
    """The framework/reference sentence: from back-to-back pairs (CPU), else from the
    rows' medians (an accelerator runs one runner at a time, with nothing else)."""
    if not pairs:
        return (f"**Framework (1,1,1) / reference: {ratio['of_medians']:.3f}**, the ratio of "
                f"median step times (runners timed one after another; of minima "
                f"{ratio['of_minima']:.3f}).")
    quartiles = statistics.quantiles(ratio["pairs"], n=4) if len(pairs) > 1 else [float("nan")] * 3
    return (f"**Framework (1,1,1) / reference: {ratio['paired']:.3f}**, the median over "
            f"{len(pairs)} back-to-back step pairs (quartiles {quartiles[0]:.3f}, "
            f"{quartiles[2]:.3f}). From the table's blocks: median of per-round ratios "
            f"{ratio['median_of_rounds']:.3f} ({', '.join(f'{r:.3f}' for r in ratio['rounds'])}), "
            f"ratio of medians {ratio['of_medians']:.3f}, of minima {ratio['of_minima']:.3f}.")


def report(cfg, devset, args, peak: tuple, rows: list[Row], ref: Row, pairs: list,
           compiled: dict, extra: list[str] = ()) -> str:
    """The whole result as Markdown: machine, settings, the table, the ratio, `extra`
    paragraphs (skipped rows, device memory, the laptop row), compile times."""
    peak_flops, per_device, peak_what = peak
    ratio = reference_ratio(rows, ref, pairs)
    m, t = cfg.model, cfg.train
    kind = "" if devset.kind.lower() == devset.platform else f" ({devset.kind})"
    lines = [
        f"# tools/bench.py, {datetime.date.today().isoformat()}",
        "",
        f"Machine: {_cpu_name()}, {os.cpu_count()} CPU cores; devices: {len(devset)} "
        f"{devset.platform}{kind}"
        f"{SIMULATED_NOTE if devset.simulated else ''}.",
        f"Model: {m.n_layers} layers, d_model {m.d_model}, vocab {m.vocab_size}, {m.dtype}, "
        f"attention {m.attention}{_resolved(cfg, devset)}; "
        f"batch {t.global_batch_size} x {t.seq_len} tokens. Timing: {args.rounds} interleaved "
        f"rounds x {args.steps} steps per runner, after {args.warmup} warm-up steps; medians.",
        f"MFU against the {peak_what}: {peak_flops / 1e9:.1f} GFLOP/s"
        f"{'' if per_device else ' (the whole host, shared by every simulated device)'}.",
        "",
        *table(cfg, rows, ref, peak_flops, per_device, devset.simulated),
        "",
        headline(ratio, pairs),
        "",
        *[line for paragraph in extra for line in (paragraph, "")],
    ]
    if compiled:
        lines += [f"Compile time (trace + compile, seconds, {args.compile_reps} interleaved "
                      f"repetitions):", ""]
    lo, hi = args.compile_layers
    for name, times in compiled.items():
        med = {n: statistics.median(x) for n, x in times.items()}
        lines.append(
            f"- {name}: {lo} layers {', '.join(f'{x:.2f}' for x in times[lo])}; {hi} layers "
            f"{', '.join(f'{x:.2f}' for x in times[hi])}; ratio of medians "
            f"{med[hi] / med[lo]:.2f}, of minima {min(times[hi]) / min(times[lo]):.2f}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", action="append", default=[],
                        help="P,D,T[:field=value...], e.g. 2,2,2:microbatches=8:schedule=1f1b")
    parser.add_argument("--no-defaults", action="store_true",
                        help="only (1,1,1), the recipe's layout and --layout's")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved blocks per runner")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    parser.add_argument("--pairs", type=int, default=20,
                        help="back-to-back (1,1,1)/reference step pairs for the ratio")
    parser.add_argument("--compile-layers", type=int, nargs=2, default=[4, 32])
    parser.add_argument("--compile-reps", type=int, default=None,
                        help="default: 3 on CPU, 0 (not measured) on accelerators")
    parser.add_argument("--attention", default=None,
                        help="kernels for extra rows at the recipe's layout, e.g. dense,blockwise "
                             "(default: dense,blockwise,cudnn on GPUs, none elsewhere)")
    parser.add_argument("--laptop", action=argparse.BooleanOptionalAction, default=None,
                        help="the laptop row (default: on CPU)")
    parser.add_argument("--markdown", type=Path, help="also write the report here")
    return parser


def attention_rows(cfg, devset, kernels: str | None, valid: list) -> list:
    """(recipe's layout, kernel) for each requested attention kernel other than the one
    `auto` (or the recipe) already runs; raises ConfigError for one that cannot run here."""
    from framework.model import attention
    from framework.errors import ConfigError
    from framework.engine.validate import check

    if kernels is None:
        kernels = "dense,blockwise,cudnn" if devset.platform == "gpu" else ""
    own = next((p for p in valid if p == cfg.parallel), valid[0])
    out = []
    for kernel in [k for k in kernels.split(",") if k]:
        model = dataclasses.replace(cfg.model, attention=kernel)
        errs = check(model, own, cfg.train, own.n_devices)
        if kernel == "auto" or errs:
            raise ConfigError(f"--attention {kernel}: " + ("; ".join(errs) or "auto is the "
                                                                            "rows' own kernel"))
        attention.check_platform(model, devset.platform)
        if kernel != _runs(cfg, devset):
            out.append((own, kernel))
    return out


def main(argv=None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    from framework.errors import ConfigError

    try:
        cfg, devset, valid = _layouts(overrides, args)
        variants = attention_rows(cfg, devset, args.attention, valid)
    except ConfigError as err:
        return user_error(err)
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # time real compilations
    peak = _peak(cfg, devset)
    print(f"{peak[2]}: {peak[0] / 1e9:.1f} GFLOP/s", flush=True)
    limit = None
    if devset.platform != "cpu":  # simulated CPU devices share the host's memory
        from framework.analysis.memory_check import device_limit

        limit = device_limit(devset)[0]
    skipped = []
    try:
        rows, ref, pairs = measure(cfg, valid + variants, devset.devices, args.steps,
                                   args.rounds, args.warmup, args.pairs, limit=limit,
                                   skipped=skipped, resident=devset.platform == "cpu")
    except ConfigError as err:
        return user_error(err)
    extra = [f"Skipped {line}." for line in skipped] + _extra_lines(cfg, devset, args)
    compiled = _compile_rows(cfg, devset, args, valid)
    text = report(cfg, devset, args, peak, rows, ref, pairs, compiled, extra)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


def _layouts(overrides: list[str], args):
    """(the composed config, the devices, the layouts that can run on them, validated)."""
    from framework.config import DevicesConfig, ParallelConfig
    from framework.engine.validate import validate
    from framework.runtime import devices as devices_lib

    cfg = compose(overrides)
    layouts = layouts_for(cfg, args.layout, not args.no_defaults)
    wanted = max(par.n_devices for par in layouts)
    devset = devices_lib.start(DevicesConfig(cfg.devices.platform, wanted), ParallelConfig())
    valid = []
    for par in layouts:
        if par.n_devices > len(devset):
            print(f"skipped {mesh_name(par)}: needs {par.n_devices} devices, {len(devset)} here")
            continue
        with warnings.catch_warnings():  # microbatches < pipeline: measured anyway
            warnings.simplefilter("ignore")
            valid.append(validate(cfg.model, par, cfg.train, par.n_devices))
    return cfg, devset, valid


def _peak(cfg, devset) -> tuple:
    """(peak FLOP/s per device, whether it is per device, where the number is from)."""
    from framework.analysis.flops import peak_flops_per_device

    if devset.platform == "cpu":
        return host_matmul_peak(devset.devices[0]), False, "host float32 matmul peak (measured)"
    return (peak_flops_per_device(devset.kind, cfg.model.dtype) or float("nan"), True,
            f"{devset.kind} {cfg.model.dtype} peak per device (table)")


def _extra_lines(cfg, devset, args) -> list[str]:
    """Paragraphs after the ratio: an accelerator's peak memory, the laptop row."""
    from framework.config import ModelConfig, ParallelConfig

    extra = []
    if devset.platform != "cpu":
        used = devset.devices[0].memory_stats() or {}
        if "peak_bytes_in_use" in used:
            extra += [f"Peak memory in use on {devset.kind} (the whole benchmark): "
                      f"{used['peak_bytes_in_use'] / 2**30:.2f} GiB of "
                      f"{used.get('bytes_limit', float('nan')) / 2**30:.2f} GiB."]
    if args.laptop if args.laptop is not None else devset.platform == "cpu":
        small = dataclasses.replace(cfg, model=ModelConfig(), parallel=ParallelConfig(),
                                    train=dataclasses.replace(cfg.train, **LAPTOP))
        lrows, lref, lpairs = measure(small, [ParallelConfig()], devset.devices[:1], args.steps,
                                      args.rounds, args.warmup, args.pairs)
        extra += laptop_lines(lrows[0], lref, lpairs)
    return extra


def _compile_rows(cfg, devset, args, valid) -> dict:
    """Compile times with few and many layers: the single device, and the recipe's own
    layout if it runs here."""
    from framework.engine.validate import check

    if args.compile_reps is None:
        args.compile_reps = 3 if devset.platform == "cpu" else 0
    compiled = {}
    timed = [valid[0]] + [p for p in valid[1:] if p == cfg.parallel] if args.compile_reps else []
    for par in timed:
        counts = [dataclasses.replace(cfg.model, n_layers=n) for n in args.compile_layers]
        if not any(check(model, par, cfg.train, par.n_devices) for model in counts):
            compiled[mesh_name(par)] = compile_times(
                cfg, par, devset.devices, tuple(args.compile_layers), args.compile_reps)
    return compiled


if __name__ == "__main__":
    sys.exit(main())
