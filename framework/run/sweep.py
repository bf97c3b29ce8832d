"""Multirun: one process per job.

JAX fixes its device count when its backend starts, and Hydra's basic launcher runs
every job of a sweep in one process. So under `-m` each job re-launches this program
as a child process,

    python -m framework.run <the job's overrides> hydra.run.dir=<job folder>
        logging.wandb.group=<sweep group> logging.wandb.name=<job name>

and waits for it. Each child simulates exactly the devices its degrees need and
writes its own metrics.jsonl / summary.json / W&B run into the job folder. A child
that rejects its configuration exits with USER_ERROR and a one-line reason on
stderr; the parent records that as a `skipped` job (summary.json with the reason)
and the sweep goes on. The job folder and W&B run are named from the degrees
(`pp2-dp2-tp2-mb8`), plus any other swept setting (`pp2-dp2-tp2-mb8_optim.lr=0.01`);
all jobs of a sweep share one W&B group.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from framework import units
from framework.parallel.mesh import mesh_name
from framework.runtime import runlock
from framework.run.tracking import SUMMARY_FILE, write_summary

USER_ERROR = 2  # exit status for bad input (composition errors, invalid degrees)
# Settings that the degree part of a job name already shows.
DEGREE_KEYS = frozenset(f"parallel.{k}" for k in (
    "pipeline", "data", "context", "tensor", "microbatches", "schedule", "virtual_stages"))


def mesh_label(parallel) -> str:
    """The degrees as a folder name: `mesh_name(parallel)` once `data: -1` is resolved;
    `dpfill` where it cannot be (the job is then skipped, and says why)."""
    if parallel.data == -1:
        return mesh_name(parallel).replace("-dp-1-", "-dpfill-", 1)
    return mesh_name(parallel)


def job_name(mesh_name: str, task_overrides: list[str], swept_keys: set[str]) -> str:
    """The degrees, plus `key=value` for every other swept setting of this job."""
    extra = [o.replace("\\", "") for o in task_overrides  # Hydra escapes ':' as '\:'
             if o.split("=", 1)[0].lstrip("+~") in swept_keys - DEGREE_KEYS]
    return mesh_name + ("_" + ",".join(extra) if extra else "")


def quote(value: str) -> str:
    """A Hydra override value that survives any characters (paths with '=' or ',')."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def run_job(overrides: list[str], job_dir: Path, group: str, name: str,
            parallel: dict, env: dict | None = None, module: str = "framework.run") -> dict:
    """Runs one job in a child process; returns its summary (also in job_dir).
    parallel: the job's degrees as composed (recorded if the child writes nothing)."""
    job_dir = Path(job_dir)
    mine = ("logging.wandb.group=", "logging.wandb.name=")
    cmd = [sys.executable, "-m", module,
           *[o for o in overrides if not o.startswith(mine)],
           f"hydra.run.dir={quote(str(job_dir))}",
           f"logging.wandb.group={quote(group)}", f"logging.wandb.name={quote(name)}"]
    busy = runlock.holder(job_dir) is not None  # another run works in this folder
    if not busy:
        (job_dir / SUMMARY_FILE).unlink(missing_ok=True)
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, env=env)
    sys.stderr.write(proc.stderr)
    summary_path = job_dir / SUMMARY_FILE
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    reason = lines[-1].strip() if lines else f"exit status {proc.returncode}"
    reason = reason.removeprefix("error: ")
    status = "skipped" if proc.returncode == USER_ERROR else "failed"
    summary = {"status": status, "reason": reason, "exit_code": proc.returncode,
               "mesh_name": name, "run_name": name, "parallel": parallel,
               "overrides": list(overrides)}
    if busy or runlock.holder(job_dir) is not None:
        return summary  # the folder is another run's: its files stay as they are
    if summary_path.exists():
        found = json.loads(summary_path.read_text())
        if found.get("status") != "running":
            return found
        summary["run_name"] = found.get("run_name", name)  # it died without a word
    # a refused job removes the empty folder it was given (framework/run/cli.py); in a
    # sweep the folder is the job's record, so its summary goes back into it
    job_dir.mkdir(parents=True, exist_ok=True)
    write_summary(job_dir, summary)
    return summary


def report_line(num: int, name: str, summary: dict) -> str:
    status = summary.get("status", "?")
    if status in ("skipped", "failed", "diverged", "interrupted"):
        return f"[sweep job {num}] {name}: {status}: {summary.get('reason', '')}"
    loss, rate = summary.get("train/loss"), summary.get("perf/tokens_per_sec")
    parts = [f"[sweep job {num}] {name}: {status}"]
    compiled = summary.get("memory/compiled_bytes_per_device")
    if compiled is not None:  # a framework.compile job
        size = units.size(compiled)
        parts.append(f"{size} per device (compiled)")
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if rate is not None:
        parts.append(f"{rate:,.0f} tok/s")
    return ", ".join(parts)
