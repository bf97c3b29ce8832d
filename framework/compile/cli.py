"""The command line of ahead-of-time compilation:

    python -m framework.compile recipe=llama_1b_8gpu target=gpu:h100x8 parallel.schedule=1f1b
    python -m framework.compile -m recipe=llama_1b_8gpu target=gpu:h100x8 \\
        parallel.schedule=gpipe,1f1b,zb_h1

The configuration is composed exactly as `python -m framework.run` composes it
(conf/compile.yaml: conf/config.yaml with `target` added), so every recipe and override
applies. Writes `compile_report.json` (and `summary.json`) in the run folder, and what
the compilers log themselves (XLA's warnings, libtpu's start-up) to `compile.log`. Exit
status 2 with one line on stderr for bad input and for a program that does not fit the
target's memory; `-m` runs one process per job, as training sweeps do. The run folder's
lock is held while compiling (a training run there is refused, and a compile in a
training run's folder is refused: its summary.json is the run's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.types import RunMode
from omegaconf import DictConfig

from framework.compile import report as report_lib
from framework.compile.targets import parse
from framework.config import CompileConfig
from framework.errors import ConfigError
from framework.io import outputs
from framework.run import cli as run_cli
from framework.run.tracking import SUMMARY_FILE
from framework.runtime import faults, runlock
from framework.runtime.quiet import stderr_to

COMPILER_LOG = "compile.log"
SWEEP_FAILED = 1  # exit status of a sweep in which a job did not compile
_NOT_COMPILED: list[str] = []  # this sweep's jobs that did not compile: "name (reason)"


@hydra.main(version_base=None, config_path=str(run_cli.CONF_DIR), config_name="compile")
def _main(cfg: DictConfig) -> None:
    hc = run_cli.task_started()
    if hc.mode == RunMode.MULTIRUN:
        summary = run_cli.launch_job(cfg, hc, module="framework.compile")
        if summary.get("status") != "compiled":
            _NOT_COMPILED.append(f"{Path(hc.runtime.output_dir).name} "
                                 f"({summary.get('status')}: {summary.get('reason', '')})")
        return
    try:
        run_cli.check_added_keys(list(hc.overrides.task), CompileConfig)
    except ConfigError as err:
        run_cli.user_error(err)
    run_cfg: CompileConfig = run_cli.typed_config(cfg)
    run_dir = Path(hc.runtime.output_dir)
    try:
        lock = hold_folder(run_dir)
    except ConfigError as err:
        run_cli.user_error(err)
    try:
        _compile(run_cfg, run_dir, {"recipe": hc.runtime.choices.get("recipe")})
    finally:
        lock.release()


def hold_folder(run_dir: Path) -> runlock.RunLock:
    """The folder's lock (framework/runtime/runlock.py), held while compiling: a
    training run there is refused (FolderBusy), as is a folder that is another tool's
    output (a training run's: its summary.json is not a compile's to replace)."""
    found = outputs.owner(run_dir) if run_dir.is_dir() else None
    if found not in (None, "compile"):
        raise ConfigError(f"hydra.run.dir={run_dir} is {outputs.KINDS[found]}: a compile "
                          f"writes summary.json and compile_report.json there, which would "
                          f"replace its own; choose another folder")
    return runlock.acquire(run_dir)


def _compile(run_cfg: CompileConfig, run_dir: Path, recipe: dict) -> None:
    from framework.compile.program import TooBig, compile_report

    try:
        with stderr_to(run_dir / COMPILER_LOG):  # the compilers' own chatter
            report = {**recipe, **compile_report(run_cfg, parse(run_cfg.target))}
    except TooBig as err:
        _write(run_dir / report_lib.REPORT_FILE, {**recipe, **err.report})
        _write(run_dir / SUMMARY_FILE, {"status": "does_not_fit", "reason": str(err),
                                        "exit_code": 2})
        run_cli.user_error(err)
    except ConfigError as err:
        run_cli.user_error(err)
    _write(run_dir / report_lib.REPORT_FILE, report)
    _write(run_dir / SUMMARY_FILE, {"status": "compiled", **report})
    print("\n".join(report_lib.lines(report)), flush=True)
    print(f"report: {run_dir / report_lib.REPORT_FILE}", flush=True)


def _write(path: Path, data: dict) -> None:
    """A report file, whole or not at all; a failure is one line (exit 4: no space)."""
    try:
        outputs.write_json(path, data)
    except OSError as err:
        print(f"error: cannot write {path}: {err.strerror or err}", file=sys.stderr,
              flush=True)
        sys.exit(faults.STORAGE_EXIT)


def main() -> None:
    run_cli.main(_main)
    if _NOT_COMPILED:  # a sweep: every job ran; say which did not compile
        print(f"error: {len(_NOT_COMPILED)} compile job(s) did not compile: "
              f"{'; '.join(_NOT_COMPILED)}", file=sys.stderr, flush=True)
        sys.exit(SWEEP_FAILED)


if __name__ == "__main__":
    sys.exit(main())
