"""The Markdown report of `tools/bench.py`: the machine and settings, one table row per
layout and the reference's, the framework/reference ratio, the laptop row and compile
times. Formatting only: the numbers come from `tools/bench_measure.py`."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from pathlib import Path

from tools.bench_measure import Measured, Peak, Row, reference_ratio

SIMULATED_NOTE = ", simulated: rows on several devices show overhead, not speed-up"
LAPTOP = {"seq_len": 64, "global_batch_size": 12}  # with ModelConfig()'s 4 x d_model 128


def table(cfg, rows: list[Row], ref: Row, peak_flops: float, per_device_peak: bool,
          simulated: bool) -> list[str]:
    """Markdown rows: one per layout, then the reference."""
    from framework.model.flops import model_flops_per_token as flops_per_token

    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    per_token = flops_per_token(cfg.model, cfg.train.seq_len)
    out = ["| layout | devices | step ms (median) | min–max ms | tokens/s | model TFLOP/s | MFU "
           "| vs reference | compile s | peak MiB/device (XLA) | planner MiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in [r for r in rows + [ref] if r.times]:  # (one out of memory: not timed)
        rate = tokens / row.step_s
        achieved = per_token * rate
        peak = peak_flops * (row.n_devices if per_device_peak else 1)
        kind = " (simulated)" if simulated and row.n_devices > 1 else ""
        mib = lambda b: "–" if b != b else f"{b / 2**20:.0f}"
        out.append(
            f"| {row.name}{'' if row.parallel is None else _extras(row.parallel)} "
            f"| {row.n_devices}{kind} | {row.step_s * 1e3:.1f} "
            f"| {min(row.times) * 1e3:.0f}–{max(row.times) * 1e3:.0f} | {rate:,.0f} "
            f"| {achieved / 1e12:.3f} | {achieved / peak:.1%} | {_versus(row, ref)} "
            f"| {row.compile_s:.1f} | {mib(row.peak_bytes)} | {mib(row.predicted_bytes)} |")
    return out


def _versus(row: Row, ref: Row) -> str:
    return f"{row.step_s / ref.step_s:.3f}" if ref.times else "–"


def _extras(par) -> str:
    parts = [k for k, on in (("zero1", par.zero1), ("sp", par.sequence_parallel)) if on]
    if par.remat != "none":
        parts.append(f"remat={par.remat}")
    return f" ({', '.join(parts)})" if parts else ""


def kernel_run(cfg, devset) -> str:
    """The attention kernel the recipe's model runs on this platform."""
    from framework.model.attention import choose

    m = cfg.model
    return m.attention if m.attention != "auto" else choose(devset.platform, m.dtype,
                                                           cfg.train.seq_len, m.head_dim)


def _resolved(cfg, devset) -> str:
    return f" (runs {kernel_run(cfg, devset)})" if cfg.model.attention == "auto" else ""


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def laptop_lines(laptop: Measured) -> list[str]:
    """The laptop row's summary: tokens/s of the framework at (1,1,1) and of plain JAX."""
    tokens = LAPTOP["seq_len"] * LAPTOP["global_batch_size"]
    row, ref, pairs = laptop.rows[0], laptop.ref, laptop.pairs
    ratio = reference_ratio(laptop)["paired"]
    return [f"**Laptop shape** (4 layers, d_model 128, seq {LAPTOP['seq_len']}, batch "
                f"{LAPTOP['global_batch_size']}, float32) at (1,1,1): framework "
                f"{tokens / row.step_s:,.0f} tokens/s (median step {row.step_s * 1e3:.1f} ms), "
                f"plain JAX {tokens / ref.step_s:,.0f} tokens/s; framework/reference "
                f"{ratio:.3f} (median of {len(pairs)} back-to-back pairs)."]


def headline(ratio: dict, pairs: list) -> str:
    """The framework/reference sentence: from back-to-back pairs (CPU), else from the
    rows' medians (an accelerator runs one runner at a time, with nothing else)."""
    if ratio["of_medians"] != ratio["of_medians"]:
        return ("**No framework (1,1,1) / reference ratio**: one of the two did not fit the "
                "device's memory (the skipped lines below).")
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


def report(cfg, devset, args, peak: Peak, measured: Measured, compiled: dict,
           extra: list[str] = ()) -> str:
    """The whole result as Markdown: machine, settings, the table, the ratio, `extra`
    paragraphs (skipped rows, device memory, the laptop row), compile times."""
    ratio = reference_ratio(measured)
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
        f"MFU against the {peak.source}: {peak.flops / 1e9:.1f} GFLOP/s"
        f"{'' if peak.per_device else ' (the whole host, shared by every simulated device)'}.",
        "",
        *table(cfg, measured.rows, measured.ref, peak.flops, peak.per_device, devset.simulated),
        "",
        headline(ratio, measured.pairs),
        "",
        *[line for paragraph in extra for line in (paragraph, "")],
    ]
    return "\n".join(lines + _compile_lines(args, compiled))


def _compile_lines(args, compiled: dict) -> list[str]:
    """Compile times with few and many layers, per layout measured."""
    lines = []
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
    return lines
