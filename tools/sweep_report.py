"""Summarise a multirun folder: a Markdown table and a chart, one row/bar per job.

    python tools/sweep_report.py multirun/2026-01-01_12-00-00 [--out DIR]

Reads every job's `summary.json` (written by `python -m framework.run -m ...`) and
writes `sweep_report.md` (degrees, microbatches, tokens/s, TFLOP/s per device,
bubble from the formula and timed on the devices, peak memory, final loss, status) and
`sweep_report.png` (throughput and bubble per configuration) into the folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEGREES = ("pipeline", "data", "context", "tensor", "microbatches")
COLUMNS = ("job", *DEGREES, "tokens/s",
           "TFLOP/s/device", "bubble (theory)", "bubble (timed)", "peak MiB/device",
           "final loss", "status")


def load_jobs(folder: Path) -> list[dict]:
    """Every job's summary.json below `folder` (W&B folders skipped), by degrees."""
    jobs = []
    for path in folder.rglob("summary.json"):
        if "wandb" in path.parts:
            continue
        summary = json.loads(path.read_text())
        summary["job"] = path.parent.relative_to(folder).as_posix()
        jobs.append(summary)
    degrees = lambda j: tuple(int(j.get("parallel", {}).get(k, 1 if k == "context" else 0))
                              for k in DEGREES)
    return sorted(jobs, key=lambda j: (degrees(j), j["job"]))


def _num(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def row(job: dict) -> list[str]:
    par = job.get("parallel", {})
    peak = job.get("memory/peak_bytes_per_device")
    status = job.get("status", "?")
    if job.get("reason") and status != "completed":
        status += ": " + job["reason"].replace("|", "/")
    par = {"context": 1, **par}  # summaries from before context parallelism
    return [job["job"], *(str(par.get(k, "")) for k in DEGREES),
            _num(job.get("perf/tokens_per_sec"), ",.0f"),
            _num(job.get("perf/tflops_per_device"), ".4g"),
            _num(job.get("pipeline/bubble_fraction"), ".1%"),
            _num(job.get("pipeline/bubble_fraction_timed"), ".1%"),
            _num(None if peak is None else peak / 2**20, ".1f"),
            _num(job.get("train/loss"), ".4f"), status]


def markdown(jobs: list[dict], title: str) -> str:
    lines = [f"# Sweep {title}", "", f"{len(jobs)} jobs, "
             f"{sum(j.get('status') == 'completed' for j in jobs)} completed.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(j)) + " |" for j in jobs]
    kinds = {(j.get("platform"), j.get("simulated_devices")) for j in jobs
             if j.get("status") == "completed"}
    if any(sim for _, sim in kinds):
        lines += ["", "Simulated CPU devices share the host's cores: throughput shows "
                      "overhead, not parallel speed-up."]
    return "\n".join(lines) + "\n"


def chart(jobs: list[dict], path: Path) -> None:
    """Two panels: tokens/s per configuration; bubble, formula vs timed on the devices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [j for j in jobs if j.get("status") == "completed"]
    names = [j.get("mesh_name", j["job"]) for j in done]
    x = range(len(done))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 1.2 * len(done) + 2), 7),
                                      sharex=True)
    top.bar(x, [j.get("perf/tokens_per_sec") or 0 for j in done], color="tab:blue")
    top.set_ylabel("tokens/s")
    top.set_title("Throughput per configuration")
    width = 0.4
    bottom.bar([i - width / 2 for i in x],
               [100 * (j.get("pipeline/bubble_fraction") or 0) for j in done], width,
               label="theoretical", color="tab:orange")
    bottom.bar([i + width / 2 for i in x],
               [100 * (j.get("pipeline/bubble_fraction_timed") or 0) for j in done],
               width, label="timed", color="tab:green")
    bottom.set_ylabel("pipeline bubble (%)")
    bottom.legend()
    bottom.set_xticks(list(x), names, rotation=30, ha="right")
    if not done:
        top.text(0.5, 0.5, "no completed jobs", ha="center", transform=top.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a multirun folder (hydra.sweep.dir)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write sweep_report.md/.png (default: the folder)")
    args = parser.parse_args(argv)
    jobs = load_jobs(args.folder) if args.folder.is_dir() else []
    if not jobs:
        print(f"error: no job summaries (summary.json) under {args.folder}", file=sys.stderr)
        return 2
    out = args.out or args.folder
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(jobs, args.folder.name)
    (out / "sweep_report.md").write_text(text)
    chart(jobs, out / "sweep_report.png")
    print(text, end="")
    print(f"wrote {out / 'sweep_report.md'} and {out / 'sweep_report.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
