"""Where a run's numbers go: the terminal, `metrics.jsonl`, `summary.json`, and the
dashboards, W&B and (optionally) TensorBoard (their sinks: framework/run/dashboards.py).

Every sink gets the same records: `log(step, metrics)` every `logging.every` steps and
`finish(summary)` once. `Tracker` fans them out and keeps the summary: the last value
of every logged key, the run's one-off numbers (compile time, memory, communication),
its resolved degrees and its status.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Protocol, TextIO

from framework.errors import StorageError

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def finite_or_none(value):
    """JSON-safe: NaN/inf become null (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Sink(Protocol):
    def log(self, step: int, metrics: dict) -> None: ...

    def finish(self, summary: dict) -> None: ...


class JsonlSink:
    """`metrics.jsonl`: one JSON object per logged step.

    Each record is one `write` of a whole line to a file opened for appending (one
    system call: a line is never split or interleaved, and a single writer is
    guaranteed by the run folder's lock, framework/runtime/runlock.py); `sync()` (before every
    checkpoint) makes the lines so far durable, so no checkpoint is on disk without the
    records of the steps it holds, even after a power loss.

    resumed_at: the step a resumed run continues from. The records up to it (written
    before the run was stopped or killed) are kept and the new ones appended; records
    after it, logged after the checkpoint the run resumes from, are dropped (the run
    logs those steps again), as is a last line cut short by a kill. The file then reads
    as if the run had never stopped, which is checked (every line parses, steps
    strictly increase, none after `resumed_at`). If anything else would be dropped
    (unreadable or out-of-order lines in the middle), or a fresh start finds records
    of an earlier attempt, the old file is kept as `metrics.jsonl.<n>` first: nothing
    is lost. The sink holds every line the file should have (`held`): a file deleted or
    cut short under the running run is noticed at the next record, written anew from
    them, and said on one line."""

    def __init__(self, run_dir: Path, resumed_at: int | None = None):
        path = Path(run_dir) / METRICS_FILE
        self.path, self.kept_aside, self.held = path, None, []
        if resumed_at is not None and path.exists():
            lines = path.read_bytes().decode(errors="replace").split("\n")
            kept, odd = _records_up_to(lines, resumed_at)
            if odd:
                self.kept_aside = _keep_aside(path)
            self.held = [(line + "\n").encode() for line in kept]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)  # atomic: a kill here leaves the old or the new file
            check_metrics(path, resumed_at)
        elif path.exists() and path.stat().st_size:
            self.kept_aside = _keep_aside(path)  # a fresh start: earlier records stay
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND
                          | (os.O_TRUNC if resumed_at is None else 0), 0o644)

    def _rewrite_if_gone(self, step: int) -> None:
        """Someone deleted or truncated the file under the run: write it anew."""
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            found = None
        mine, expected = os.fstat(self.fd), sum(map(len, self.held))
        if found is not None and found.st_ino == mine.st_ino and found.st_size >= expected:
            return
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
        os.write(self.fd, b"".join(self.held))
        print(f"warning: {self.path} was {'deleted' if found is None else 'cut short'} under "
              f"the run before step {step}: written anew from the {len(self.held)} records "
              f"the run holds", file=sys.stderr, flush=True)

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{k: finite_or_none(v) for k, v in metrics.items()}}
        line = (json.dumps(record) + "\n").encode()
        try:
            self._rewrite_if_gone(step)
            written = os.write(self.fd, line)
        except OSError as err:
            raise StorageError(f"could not write {self.path}: {err.strerror} (errno "
                               f"{err.errno}) at step {step}") from None
        if written != len(line):
            raise StorageError(f"could not write {self.path}: {written} of {len(line)} "
                               f"bytes written at step {step} (disk full?)")
        self.held.append(line)

    def sync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError:
            pass  # e.g. a filesystem without fsync; the lines are written already

    def finish(self, summary: dict) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _records_up_to(lines: list[str], step: int) -> tuple[list[str], int]:
    """(the lines to keep: valid records of steps <= step in increasing order, how many
    other lines are dropped that are not just records after `step` or a last line cut
    short by a kill)."""
    kept, odd, last = [], 0, 0
    cut_short = len(lines) - 1 if lines and lines[-1] else None  # no final newline
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        record = _parse(line)
        if record is None:
            odd += i != cut_short
        elif record["step"] > step:
            continue
        elif record["step"] <= last:
            odd += 1  # repeated or out of order
        else:
            kept.append(line)
            last = record["step"]
    return kept, odd


def _keep_aside(path: Path) -> Path:
    for n in range(1, 10_000):
        aside = path.with_name(f"{path.name}.{n}")
        if not aside.exists():
            path.replace(aside)
            return aside
    raise StorageError(f"too many old copies of {path}")


def check_metrics(path: Path, resumed_at: int) -> None:
    """Raises StorageError unless every line of `path` is a record, steps strictly
    increase, and none is after `resumed_at`."""
    last = 0
    for line in Path(path).read_text().splitlines():
        record = _parse(line)
        if record is None or not last < record["step"] <= resumed_at:
            raise StorageError(f"{path} is not as written after truncating it to step "
                               f"{resumed_at} (line {line[:80]!r}); the original is kept")
        last = record["step"]


def _parse(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    path = Path(run_dir) / METRICS_FILE
    return [r for line in path.read_text().splitlines() if (r := _parse(line)) is not None]


SUMMARY_RESERVE = 64 * 1024  # bytes the first summary of a run holds on disk


def write_summary(run_dir: Path, summary: dict, reserve: int = 0) -> Path:
    """summary.json, replaced whole or not at all: written to a temporary file that is
    renamed over the old one, so a failed write leaves the previous summary intact.
    `reserve`: pad the file to that many bytes (JSON allows trailing spaces): on a disk
    that is full by the end of the run, the last summary is written over those bytes
    in place, which needs no new space."""
    path = Path(run_dir) / SUMMARY_FILE
    text = json.dumps({k: finite_or_none(v) for k, v in summary.items()}, indent=2) + "\n"
    text += " " * max(0, reserve - len(text))
    tmp = path.with_name(f".{SUMMARY_FILE}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        size = path.stat().st_size if path.exists() else 0
        if len(text) > size:
            raise
        with open(path, "r+") as f:  # the reserved bytes: no new blocks needed
            f.write(text.ljust(size))
            f.flush()
            os.fsync(f.fileno())
    finally:
        tmp.unlink(missing_ok=True)
    return path


class ProgressBar:
    """A dependency-free progress line: redrawn in place on a terminal, one line per
    logged step otherwise (CI logs, pipes)."""

    def __init__(self, total: int, stream: TextIO = sys.stdout, first: int = 0):
        self.total, self.stream = total, stream
        self.first = first  # steps already done when this process started (resumed)
        self.tty = stream.isatty()
        self.start = time.perf_counter()
        self.last: dict = {}

    def _line(self, step: int) -> str:
        frac = step / max(self.total, 1)
        width = 24
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        elapsed = time.perf_counter() - self.start
        done = (step - self.first) / max(self.total - self.first, 1)  # of this process's part
        eta = elapsed / done - elapsed if done > 0 else 0.0
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
    """Fans records out to the sinks and builds `summary.json` (written only when
    `write`: in a multi-process run, process 0 alone writes files)."""

    def __init__(self, run_dir: Path, sinks: list, summary: dict, write: bool = True):
        self.run_dir = Path(run_dir)
        self.sinks = sinks
        self.write = write
        self.summary = {"status": "running", **summary}
        if write:  # there is a valid summary.json from the start, with room for the last
            try:
                write_summary(self.run_dir, self.summary, reserve=SUMMARY_RESERVE)
            except OSError:
                pass  # a full disk already: the run's first write will say so
    def log(self, step: int, metrics: dict) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)
        self.summary["step"] = step
        self.summary.update({k: v for k, v in metrics.items() if v is not None})

    def update(self, step: int) -> None:
        for sink in self.sinks:
            if hasattr(sink, "update"):
                sink.update(step)

    def sync(self) -> None:
        """Makes the records so far durable (called before every checkpoint)."""
        for sink in self.sinks:
            if hasattr(sink, "sync"):
                sink.sync()

    def finish(self, status: str, **extra) -> dict:
        """Writes summary.json and closes the sinks. A full disk here leaves the summary
        unwritten (the run's error line says why) rather than adding a traceback."""
        self.summary.update(status=status, **extra)
        if self.write:
            try:
                write_summary(self.run_dir, self.summary)
            except OSError:
                pass
        for sink in self.sinks:
            try:
                sink.finish(self.summary)
            except OSError:
                pass
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
        timed = summary.get("pipeline/bubble_fraction_timed")
        parts.append(f"bubble {summary['pipeline/bubble_fraction']:.1%}"
                     + (f" (timed {timed:.1%})" if timed is not None else ""))
    if summary.get("wall_time_s") is not None:
        parts.append(f"{summary['wall_time_s']:.1f} s")
    return " | ".join(parts)
