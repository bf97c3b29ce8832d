"""The timing of `tools/bench.py`: the framework's compiled step per layout and the plain
JAX reference step (`framework/model/reference.py`), on the same parameters and batch.

Every runner is compiled first (compilation never timed), then warmed up. On CPU the
runners stay resident and are timed in interleaved blocks, a shuffled order per round,
and `Timing.pairs` back-to-back (1,1,1)/reference steps follow. On an accelerator each
runner is built, timed and freed in turn (one large model's state at a time). Layouts
predicted not to fit a device's memory are left out before anything is built.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass, field

from framework.analysis import audit
from framework.parallel.mesh import mesh_name
from framework.units import size

REFERENCE = "reference (plain JAX)"  # the reference's row name


@dataclass(frozen=True)
class Timing:
    """How every runner is timed: `rounds` blocks of `steps` individually timed steps,
    after `warmup` untimed steps; then `pairs` back-to-back (1,1,1)/reference step pairs
    (resident runners only). `seed` shuffles the order of the blocks in each round."""

    steps: int = 5
    rounds: int = 3
    warmup: int = 2
    pairs: int = 20
    seed: int = 0


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


@dataclass(frozen=True)
class Measured:
    """What `measure` found: one row per layout that ran (the first: (1,1,1) with the
    reference's settings), the reference's row, and the back-to-back step pairs
    [(framework s, reference s), ...] (empty when the runners were timed one at a time)."""

    rows: list[Row]
    ref: Row
    pairs: list


@dataclass(frozen=True)
class Peak:
    """The MFU's denominator: FLOP/s, per device (accelerators: the peak table) or of the
    whole host (CPU: measured, shared by every simulated device), and where it is from."""

    flops: float
    per_device: bool
    source: str


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


def peak_for(cfg, devset) -> Peak:
    """CPU: the host's float32 matmul peak, measured; accelerators: the peak table's."""
    from framework.hardware import peak_flops

    if devset.platform == "cpu":
        return Peak(host_matmul_peak(devset.devices[0]), False,
                    "host float32 matmul peak (measured)")
    return Peak(peak_flops(devset.kind, cfg.model.dtype) or float("nan"), True,
                f"{devset.kind} {cfg.model.dtype} peak per device (table)")


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
        self.predicted_bytes = predict_memory(model, par, cfg.train, optim=cfg.optim)["total"]

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
        from framework.engine.state import as_dtype  # the engine rows' stored dtype

        self.params = jax.device_put(as_dtype(params, cfg.optim.param_dtype), device)
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


def measure(cfg, layouts: list, devices, timing: Timing = Timing(), log=print,
            limit: float | None = None, skipped: list | None = None,
            resident: bool = True) -> Measured:
    """Times every layout and the reference, interleaved, then the back-to-back pairs
    of the first layout and the reference (alternating which goes first): on a shared
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
    if not resident:
        rows = [_alone(cfg, variant, devices, params, tokens, timing, log, skipped)
                for variant in fitting + [(REFERENCE, None, None)]]
        return Measured(rows[:-1], rows[-1], [])
    runners, rows = [], []
    for name, par, model in fitting + [(REFERENCE, None, None)]:
        runner, row = _runner(cfg, (name, par, model), devices, params, tokens)
        rows.append(row)
        log(f"compiled {name} in {runner.compile_s:.1f}s")
        runners.append(runner)
    _time_interleaved(runners, rows, timing, log)
    return Measured(rows[:-1], rows[-1], _paired(runners[0], runners[-1], timing.pairs))


def _fitting(cfg, layouts, limit, log, skipped) -> list:
    """(name, parallel, model) of the layouts predicted to fit `limit` (bytes/device)."""
    from framework.analysis.memory_model import predict_memory

    fitting = []
    for i, layout in enumerate(layouts):
        name, par, model = _variant(cfg, layout)
        need = predict_memory(model, par, cfg.train, optim=cfg.optim)["total"] if limit else 0
        if limit and need > limit:
            line = (f"{name}: predicted {size(need)} per device, over the "
                    f"{size(limit)} limit: not run")
            if i == 0:
                from framework.errors import ConfigError

                raise ConfigError(f"{line} (it is the reference's shape: lower "
                                  f"train.global_batch_size)")
            log(f"skipped {line}")
            (skipped if skipped is not None else []).append(line)
            continue
        fitting.append((name, par, model))
    return fitting


def _runner(cfg, variant: tuple, devices, params, tokens):
    """(runner, its row) for a (name, parallel, model) variant: the reference's for
    parallel None, else the framework's."""
    name, par, model = variant
    if par is None:
        runner = _ReferenceRunner(cfg, devices[0], params, tokens)
        return runner, Row(name, None, 1, compile_s=runner.compile_s)
    runner = _EngineRunner(cfg, par, devices, params, tokens, model)
    return runner, Row(name, par, par.n_devices, compile_s=runner.compile_s,
                       peak_bytes=runner.peak_bytes, predicted_bytes=runner.predicted_bytes)


def _alone(cfg, variant: tuple, devices, params, tokens, timing: Timing, log,
           skipped) -> Row:
    """One runner built, timed and freed (an accelerator's way). One that runs out of
    device memory (the memory model's prediction was under the limit, or the reference,
    which it does not predict) is a line in `skipped` and a row without times (the
    report leaves it out): the rows measured before it are kept."""
    name, par, _ = variant
    try:
        runner, row = _runner(cfg, variant, devices, params, tokens)
        log(f"compiled {name} in {runner.compile_s:.1f}s")
        _time_alone(runner, row, timing)
        return row  # (the runner's state is freed on return)
    except Exception as err:  # noqa: BLE001 (XLA's runtime errors have no common type)
        if "RESOURCE_EXHAUSTED" not in str(err) and "out of memory" not in str(err).lower():
            raise
        line = f"{name}: out of device memory ({str(err).strip().splitlines()[0][:160]}): not run"
        log(f"skipped {line}")
        (skipped if skipped is not None else []).append(line)
        return Row(name, par, 1 if par is None else par.n_devices)


def _time_alone(runner, row: Row, timing: Timing) -> None:
    for _ in range(timing.warmup):
        runner.step().block_until_ready()
    for _ in range(timing.rounds):
        block = [_timed_step(runner) for _ in range(timing.steps)]
        row.times += block
        row.rounds.append(statistics.median(block))


def _time_interleaved(runners, rows, timing: Timing, log) -> None:
    """Every round, each runner's block of steps, in a shuffled order per round."""
    for runner in runners:
        for _ in range(timing.warmup):
            runner.step().block_until_ready()
    order = list(range(len(runners)))
    shuffle = random.Random(timing.seed)
    for r in range(timing.rounds):
        shuffle.shuffle(order)
        for i in order:
            _timed_step(runners[i])  # untimed: the previous runner's caches, allocation
            block = [_timed_step(runners[i]) for _ in range(timing.steps)]
            rows[i].times += block
            rows[i].rounds.append(statistics.median(block))
        log(f"round {r + 1}/{timing.rounds} done")


def _paired(framework_runner, ref, pairs: int) -> list:
    """[(framework s, reference s), ...]: back-to-back steps, alternating which first."""
    paired = []
    for k in range(pairs):
        first, second = (framework_runner, ref) if k % 2 == 0 else (ref, framework_runner)
        a, b = _timed_step(first), _timed_step(second)
        paired.append((a, b) if k % 2 == 0 else (b, a))
    return paired


def reference_ratio(measured: Measured) -> dict:
    """Framework (1,1,1) (the first row, see `layouts_for` in tools/bench.py) / reference,
    four ways: the median of back-to-back step pairs (the headline: robust to load
    changing over time), the median of per-round ratios, the ratio of medians and of
    minima."""
    one, ref, pairs = measured.rows[0], measured.ref, measured.pairs
    if not ref.times or not one.times:  # the reference (or the first row) did not fit
        nan = float("nan")
        return {"paired": nan, "pairs": [], "median_of_rounds": nan, "rounds": [],
                "of_medians": nan, "of_minima": nan}
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


def profile(cfg, par, devices, steps: int = 3):
    """Where one layout's step spends its device time (framework/analysis/device_time.py):
    the engine's step run `steps` times under `jax.profiler` after one untimed step."""
    import tempfile

    import jax

    from framework.analysis import device_time
    from framework.model.reference import tokens_for_step
    from framework.model.registry import spec_of

    params = jax.jit(lambda key: spec_of(cfg.model).init_params(cfg.model, key))(
        jax.random.key(cfg.train.seed))
    tokens = tokens_for_step(cfg.train.seed, 0, cfg.train.global_batch_size,
                             cfg.train.seq_len, cfg.model.vocab_size)
    runner = _EngineRunner(cfg, par, devices, params, tokens)
    runner.step().block_until_ready()
    with tempfile.TemporaryDirectory() as folder:
        return device_time.profile_steps(lambda: runner.step().block_until_ready(), steps,
                                         folder, runner.engine.compiled.as_text())

