"""Where a run's numbers go: the terminal, `metrics.jsonl`, `summary.json` and W&B.

Every sink gets the same records: `log(step, metrics)` every `logging.every` steps and
`finish(summary)` once. `Tracker` fans them out and keeps the summary: the last value
of every logged key, the run's one-off numbers (compile time, memory, communication),
its resolved degrees and its status.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Protocol, TextIO

from framework.config import WandbConfig

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def _clean(value):
    """JSON-safe: NaN/inf become null (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Sink(Protocol):
    def log(self, step: int, metrics: dict) -> None: ...

    def finish(self, summary: dict) -> None: ...


class JsonlSink:
    """`metrics.jsonl`: one JSON object per logged step, flushed as it is written."""

    def __init__(self, run_dir: Path):
        self.file = open(Path(run_dir) / METRICS_FILE, "w")

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def finish(self, summary: dict) -> None:
        self.file.close()


def write_summary(run_dir: Path, summary: dict) -> Path:
    path = Path(run_dir) / SUMMARY_FILE
    path.write_text(json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2) + "\n")
    return path


class WandbSink:
    """One W&B run. Offline mode writes `<run_dir>/wandb/offline-run-*/run-*.wandb`,
    which `wandb sync` uploads later; the resolved config is the run's config."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, name: str, config: dict):
        import wandb

        self.run = wandb.init(
            mode=cfg.mode, project=cfg.project, entity=cfg.entity, group=cfg.group,
            name=name, dir=str(run_dir), config=config, reinit="finish_previous",
            settings=wandb.Settings(console="off", silent=True, disable_git=True))
        self.dir = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id>

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({k: v for k, v in metrics.items() if _clean(v) is not None}, step=step)

    def finish(self, summary: dict) -> None:
        flat = {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))}
        self.run.summary.update(flat)
        self.run.finish(exit_code=0 if summary.get("status") == "completed" else 1)


class ProgressBar:
    """A dependency-free progress line: redrawn in place on a terminal, one line per
    logged step otherwise (CI logs, pipes)."""

    def __init__(self, total: int, stream: TextIO = sys.stdout):
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self.start = time.perf_counter()
        self.last: dict = {}

    def _line(self, step: int) -> str:
        frac = step / max(self.total, 1)
        width = 24
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        parts = [f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] {frac:4.0%}"]
        if "train/loss" in self.last:
            parts.append(f"loss {self.last['train/loss']:.4f}")
        if self.last.get("perf/tokens_per_sec") is not None:
            parts.append(f"{self.last['perf/tokens_per_sec']:,.0f} tok/s")
        parts.append(f"{_clock(elapsed)}<{_clock(eta)}")
        return " | ".join(parts)

    def update(self, step: int) -> None:
        """Called every step; draws only on a terminal."""
        if self.tty:
            cols = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + self._line(step)[: cols - 1].ljust(cols - 1))
            self.stream.flush()

    def log(self, step: int, metrics: dict) -> None:
        self.last = metrics
        if self.tty:
            self.update(step)
        else:
            self.stream.write(self._line(step) + "\n")
            self.stream.flush()

    def finish(self, summary: dict) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Tracker:
    """Fans records out to the sinks and builds `summary.json`."""

    def __init__(self, run_dir: Path, sinks: list, summary: dict):
        self.run_dir = Path(run_dir)
        self.sinks = sinks
        self.summary = {"status": "running", **summary}

    def log(self, step: int, metrics: dict) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)
        self.summary["step"] = step
        self.summary.update({k: v for k, v in metrics.items() if v is not None})

    def update(self, step: int) -> None:
        for sink in self.sinks:
            if hasattr(sink, "update"):
                sink.update(step)

    def finish(self, status: str, **extra) -> dict:
        self.summary.update(status=status, **extra)
        write_summary(self.run_dir, self.summary)
        for sink in self.sinks:
            sink.finish(self.summary)
        return self.summary


def final_line(summary: dict) -> str:
    """The one-line summary printed when a run ends."""
    parts = [f"{summary.get('status', '?')}: {summary.get('mesh_name', '')}",
             f"step {summary.get('step', 0)}"]
    if summary.get("train/loss") is not None:
        parts.append(f"loss {summary['train/loss']:.4f}")
    if summary.get("perf/tokens_per_sec") is not None:
        parts.append(f"{summary['perf/tokens_per_sec']:,.0f} tok/s")
        parts.append(f"{summary['perf/tflops_per_device']:.4g} TFLOP/s/device")
    if summary.get("perf/mfu") is not None:
        parts.append(f"MFU {summary['perf/mfu']:.1%}")
    if summary.get("pipeline/bubble_fraction") is not None:
        parts.append(f"bubble {summary['pipeline/bubble_fraction']:.1%}")
    if summary.get("wall_time_s") is not None:
        parts.append(f"{summary['wall_time_s']:.1f} s")
    return " | ".join(parts)
