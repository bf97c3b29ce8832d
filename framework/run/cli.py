"""The command line of training, the only module that knows Hydra
(`framework/run/__main__.py` starts it):

    python -m framework.run recipe=llama_small_3d [key=value ...]
    python -m framework.run -m recipe=llama_small_3d parallel.pipeline=1,2 parallel.data=-1

Configuration: `conf/config.yaml` (groups model/, parallel/, optim/, data/,
logging/) on top of the typed schema `framework.config.RunConfig`, then a recipe from
the top-level `recipes/` folder. Recipes are registered as the config group `recipe`
from the package's location, so they are found from any working directory.

Bad input (unknown recipe, misspelled key, wrong type, a number out of range, invalid
degrees, an output folder that cannot be created, a folder another run holds) ends
with exit status 2 and one line on stderr, before anything is compiled. A run stopped
by a non-finite loss ends with exit status 3 and one line, one whose checkpoint could
not be written with exit status 4 and one line (framework/errors.py); one that was
preempted (SIGTERM) or reached train.stop_at exits 0 after its last checkpoint. SIGTERM
and SIGINT are handled from the first instant: `__main__` installs the handlers
before this module imports Hydra and JAX.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config import (CompileConfig, DevicesConfig, ParallelConfig, RunConfig,
                              setting_names)
from framework.errors import ConfigError, DataError, Diverged, StorageError
from framework.parallel.mesh import resolve_data_degree
from framework.run import sweep
from framework.runtime import devices, faults

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = ROOT / "conf"
RECIPES_DIR = ROOT / "recipes"
_USER_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR")  # set: the user wants tracebacks


def register_configs() -> None:
    """The schema, the recipes (group `recipe`, global package) and the resolvers."""
    store = ConfigStore.instance()
    store.store(group="schema", name="run", node=RunConfig, package="_global_")
    store.store(group="schema", name="compile", node=CompileConfig, package="_global_")
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path),
                    package="_global_")
    OmegaConf.register_new_resolver("job_dirname", _job_dirname, replace=True)


GROUPS = ("model", "parallel", "optim", "data", "logging", "recipe", "schema")


def check_added_keys(task: list[str], schema=RunConfig) -> None:
    """Hydra adds any key given with `+` (or `++`), even one the schema lacks, which the
    run would then ignore: such a key must still be a setting (or a config group)."""
    import difflib

    names = setting_names(schema)
    sections = {n.split(".")[0] for n in names}
    for override in task:
        if not override.startswith("+"):
            continue
        key = override.lstrip("+").split("=", 1)[0]
        if key in names or key in GROUPS or key in sections or key.startswith("hydra"):
            continue
        close = difflib.get_close_matches(key, names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{override.split('=', 1)[0]} is not a setting{hint}: see "
                          f"docs/configuration.md")


def top_level_keys(text: str) -> list[str]:
    """The keys of a mapping written on the command line ({a: x, b: {c: 1}} -> a, b)."""
    keys, depth, part = [], 0, ""
    for char in text.strip()[1:-1] + ",":
        depth += (char in "{[") - (char in "}]")
        if char == "," and depth == 0:
            keys.append(part.split(":", 1)[0].strip().strip("'\""))
            part = ""
        else:
            part += char
    return [k for k in keys if k]


def check_duplicate_keys(task: list[str]) -> None:
    """Hydra keeps the last of two equal keys of a mapping given on the command line
    (eval.sets={val: a/, val: b/} evaluates b/ only): one line instead."""
    for override in task:
        key, _, value = override.lstrip("+~").partition("=")
        if value.strip().startswith("{") and value.strip().endswith("}"):
            keys = top_level_keys(value)
            twice = next((k for k in keys if keys.count(k) > 1), None)
            if twice is not None:
                raise ConfigError(f"{key} names {twice!r} twice: give each entry its own "
                                  f"name")


def check_run_dir(hydra_overrides: list[str]) -> None:
    """An empty `hydra.run.dir=` would put the run in the current folder, where the
    next such run would resume from it."""
    if "hydra.run.dir=" in hydra_overrides:
        raise ConfigError("hydra.run.dir is empty: name the run's folder (the default is "
                          "outputs/<date>/<time>)")


def _swept_keys(root: DictConfig) -> set[str] | None:
    """Keys this sweep varies: `a=1,2`-style arguments and hydra.sweeper.params. None
    when this process's command line is not the sweep's (a launcher such as submitit
    runs the job in another process, whose arguments are its own)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, keys, given = OverridesParser.create(), set(), set()
    for arg in sys.argv[1:]:
        try:
            override = parser.parse_override(arg)
        except Exception:  # flags such as -m, --cfg and their values
            continue
        given.add(override.key_or_group)
        if override.is_sweep_override():
            keys.add(override.key_or_group)
    task = {o.split("=", 1)[0].lstrip("+~") for o in root.hydra.overrides.task}
    if task and not task & given:
        return None
    params = OmegaConf.select(root, "hydra.sweeper.params", default=None) or {}
    return keys | set(params)


def _job_dirname(*, _root_: DictConfig) -> str:
    """hydra.sweep.subdir: the job's resolved degrees (+ other swept settings, or the
    job number where they cannot be known: never one folder for two jobs, since a job
    resumes from the checkpoints it finds in its folder)."""
    try:
        parallel = ParallelConfig(**OmegaConf.to_container(_root_.parallel, resolve=True))
        found = DevicesConfig(**OmegaConf.to_container(_root_.devices, resolve=True))
        count = devices.planned_count(found, parallel)
        if count is not None:
            try:
                parallel = resolve_data_degree(parallel, count)
            except ConfigError:
                pass  # the job reports why (skipped); its folder says dpfill
        label = sweep.mesh_label(parallel)
        task = list(_root_.hydra.overrides.task)
        swept = _swept_keys(_root_)
        if swept is None:
            return f"{label}_job{_root_.hydra.job.num}"
        return sweep.job_name(label, task, swept)
    except Exception:  # never break the sweep over a folder name
        return f"job{_root_.hydra.job.num}"


def typed_config(cfg: DictConfig):
    """The composed config as the schema's dataclasses (RunConfig, CompileConfig). A value
    the schema itself refuses (e.g. parallel.stage_layers=4: framework/config/) is one
    line and exit status 2, said here: raised into Hydra, it would add a line of its own."""
    try:
        return OmegaConf.to_object(cfg)
    except (ConfigError, OmegaConfBaseException) as err:
        user_error(err)


_TASK_STARTED = False  # Hydra has created the output folder and called the task


def task_started():
    """Called first by a Hydra task (here and framework/compile/cli.py): from now on an
    OSError is the task's, not Hydra's failure to create the output folder."""
    global _TASK_STARTED
    _TASK_STARTED = True
    return HydraConfig.get()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _main(cfg: DictConfig) -> None:
    hc = task_started()
    if hc.mode == RunMode.MULTIRUN:
        launch_job(cfg, hc)
        return
    try:
        check_added_keys(list(hc.overrides.task))
        check_duplicate_keys(list(hc.overrides.task))
        check_run_dir(list(hc.overrides.hydra))
    except ConfigError as err:
        user_error(err)
    run_cfg: RunConfig = typed_config(cfg)
    from framework.run import train

    run_dir = Path(hc.runtime.output_dir)
    if faults.command_line():  # for the rest of this process (not in the tests' own)
        log = run_dir / f"{hc.job.name}.log"
        train.watch_peers(run_cfg, run_dir, log)  # a multi-process run's native stderr
        # Libraries' background noise (e.g. a failed save's tracebacks) to run.log only.
        faults.LibraryOutput(log).install()
    try:
        train.run(run_cfg, run_dir, OmegaConf.to_container(cfg, resolve=True),
                  on_start=lambda: _save_hydra_files(cfg, run_dir),
                  model_given=given_model_settings(list(hc.overrides.task),
                                                   hc.runtime.choices.get("recipe")))
    except ConfigError as err:  # exit here: Hydra would add a line of its own
        user_error(err)
    except Diverged as err:  # summary.json already says "diverged"
        _fault(err, faults.DIVERGED_EXIT)
    except StorageError as err:  # summary.json (if it could be written): "failed"
        _fault(err, faults.STORAGE_EXIT)
    except DataError as err:  # a shard damaged mid-run; the last checkpoint is intact
        _fault(err, faults.DATA_EXIT)


HYDRA_FILES = ".hydra"  # what Hydra writes itself unless hydra.output_subdir is null


def _save_hydra_files(cfg: DictConfig, run_dir: Path) -> None:
    """The composed config, Hydra's config and the overrides, as Hydra would write them
    (conf/config.yaml turns that off: here they are written once the folder is held)."""
    folder = run_dir / HYDRA_FILES
    folder.mkdir(parents=True, exist_ok=True)
    hydra_cfg = HydraConfig.instance().cfg
    for name, node in (("config.yaml", cfg), ("hydra.yaml", hydra_cfg),
                       ("overrides.yaml", hydra_cfg.hydra.overrides.task)):
        (folder / name).write_text(OmegaConf.to_yaml(node))


def _fault(err: BaseException, status: int):
    if _USER_FULL_ERROR == "1":
        raise err
    print(f"error: {err}", file=sys.stderr, flush=True)
    sys.exit(status)


def given_model_settings(task: list[str], recipe: str | None) -> set[str]:
    """Names of the model.* settings chosen on purpose: `model.X=` on the command line,
    a `model=` group picked there or by the recipe (every key of that group's file), and
    the recipe's own `model:` values. The default group does not count: with
    train.init_from the model comes from config.json, and only these may contradict it."""
    names, groups = set(), []
    for override in task:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "model":
            groups.append(value)
        elif key.startswith("model."):
            names.add(key.split(".")[1])
    if recipe and (RECIPES_DIR / f"{recipe}.yaml").is_file():
        content = OmegaConf.to_container(OmegaConf.load(RECIPES_DIR / f"{recipe}.yaml"))
        names.update((content.get("model") or {}).keys())
        for entry in content.get("defaults") or []:  # e.g. {"override /model": "llama_1b"}
            if isinstance(entry, dict):
                groups += [v for k, v in entry.items()
                           if k.replace("override", "").strip().strip("/") == "model"]
    for group in groups:
        path = CONF_DIR / "model" / f"{group}.yaml"
        if path.is_file():
            names.update((OmegaConf.to_container(OmegaConf.load(path)) or {}).keys())
    return names


def launch_job(cfg: DictConfig, hc, module: str = "framework.run") -> dict:
    """Multirun parent: this job runs in its own process (see framework/run/sweep.py);
    returns its summary."""
    faults.sweep_started()
    job_dir = Path(hc.runtime.output_dir)
    group = cfg.logging.wandb.group or Path(hc.sweep.dir).name
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    if _USER_FULL_ERROR is not None:
        env["HYDRA_FULL_ERROR"] = _USER_FULL_ERROR
    parallel = OmegaConf.to_container(cfg.parallel, resolve=True)
    if hc.job.num == 0:  # the folder tools/sweep_report.py reads
        print(f"sweep folder: {hc.sweep.dir} (python tools/sweep_report.py {hc.sweep.dir})",
              flush=True)
    summary = sweep.run_job(list(hc.overrides.task), job_dir, group, job_dir.name,
                            parallel, env, module)
    print(sweep.report_line(hc.job.num, job_dir.name, summary), flush=True)
    return summary


def one_line(err: BaseException) -> str:
    """A user error as one line: Hydra's message, what caused it, the valid options."""
    def first(e):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return lines[0].rstrip(".") if lines else type(e).__name__

    parts = [first(err)]
    if err.__cause__ is not None:
        parts.append(first(err.__cause__))
    full_key = getattr(err, "full_key", None)
    if isinstance(err, OmegaConfBaseException) and full_key:
        parts.append(f"key {full_key}")
    text = ": ".join(parts)
    if "LexerNoViableAltException" in text:  # e.g. an unquoted path with non-ASCII letters
        override = text.split("LexerNoViableAltException: ", 1)[-1]
        key, _, value = override.partition("=")
        text = (f"cannot read the override {override}: quote the value, as in "
                f"\"{key}='{value}'\" (Hydra reads unquoted values in ASCII only)")
    if isinstance(err, MissingConfigException) and err.options:
        text += f" (available: {', '.join(sorted(err.options))})"
    return text


# At import, not only in main(): launchers that run jobs in other processes (e.g.
# Hydra's submitit launcher on SLURM) import this module there and resolve the job's
# folder name (`job_dirname`) in that process.
register_configs()


def main(task=None) -> None:
    """Runs a Hydra task (default: training) with every user error as one line."""
    # Hydra prints composition errors over several lines (and a traceback for errors
    # in the task); with HYDRA_FULL_ERROR it raises them instead, and we print one line.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        (task or _main)()
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        user_error(err)
    except KeyboardInterrupt:  # summary.json already says "interrupted"
        print("error: interrupted", file=sys.stderr, flush=True)
        sys.exit(faults.INTERRUPTED_EXIT)
    except OSError as err:
        if _TASK_STARTED or _USER_FULL_ERROR == "1":
            raise
        # Hydra could not create the output folder (or its log file in it).
        where = err.filename or "the output folder"
        user_error(ConfigError(f"cannot create the output folder {where}: {err.strerror}: "
                                f"set hydra.run.dir (or hydra.sweep.dir) to a folder that "
                                f"can be written"))


def user_error(err: BaseException):
    if _USER_FULL_ERROR == "1":
        raise err
    _remove_unused_run_dir()
    print(f"error: {one_line(err)}", file=sys.stderr, flush=True)
    sys.exit(sweep.USER_ERROR)


def _remove_unused_run_dir() -> None:
    """A refused run leaves no folder behind: Hydra creates the run folder (and its
    empty log) before the task can check anything. Removed only when it holds nothing
    else, with the default outputs/<date>/ above it when that is left empty."""
    if not _TASK_STARTED or not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    if hc.mode != RunMode.RUN:
        return
    folder = Path(hc.runtime.output_dir)
    try:
        held = list(folder.iterdir())
        if any(p.name != f"{hc.job.name}.log" or p.stat().st_size for p in held):
            return
        for p in held:
            p.unlink()
        folder.rmdir()
        default = not any(o.startswith("hydra.run.dir=") for o in hc.overrides.hydra)
        for parent in (folder.parent, folder.parent.parent) if default else ():
            parent.rmdir()  # OSError when not empty: kept
    except OSError:
        pass

