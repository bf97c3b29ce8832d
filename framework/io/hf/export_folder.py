"""Where tools/export_hf.py may write, and how an export replaces the previous one.

An export is recognised by its manifest, `export_hf.json`, which lists the files the
export wrote; it is moved into place last, so a folder with a manifest holds a whole
export. A folder without one is never taken for an export, even if it holds only
config.json and safetensors: a downloaded Hugging Face model looks exactly the same,
and guessing wrong would delete it.

    the output folder                      export
    missing, empty                         writes it
    a previous export (manifest, and no    replaces it whole (no old shard is left)
      file it does not list)
    anything else with files               refused; --overwrite replaces it whole
    holding sub-folders                    refused, even with --overwrite
    holding checkpoints (a run folder,     refused, even with --overwrite: generation
      a checkpoint or a step folder)         from a run folder reads its checkpoints
    another tool's output (a prepared      refused, even with --overwrite
      corpus, a compile report)

The new export is written into `<out>/.export-partial/` first; only when every file is
there are the old files removed and the new ones renamed into `<out>`. A failure while
writing (a full disk, an interrupt) leaves the previous export as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from framework.errors import ConfigError
from framework.io import outputs
from framework.io.checkpoint.paths import holds_checkpoints

MANIFEST = "export_hf.json"
STAGING = ".export-partial"  # inside the output folder: the same filesystem, so renames
WRITER = "tools/export_hf.py"


@dataclass(frozen=True)
class Destination:
    path: Path
    replaces: tuple[str, ...]  # what is in the folder now and will be removed
    previous_export: bool  # those are the files of an export's manifest


def entries(folder: str | Path) -> list[str]:
    """The folder's entries, without the staging folder an interrupted export left."""
    return sorted(e for e in os.listdir(folder) if e != STAGING)


def previous_export(folder: Path) -> list[str] | None:
    """The files of the export in `folder` (its manifest's list), or None when the folder
    is not exactly an export: no readable manifest, or files the manifest does not list
    (a user's notes, an older export's shards) that replacing it would delete."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return files if set(entries(folder)) <= {*files, MANIFEST} else None


def _shown(names: list[str], limit: int = 4) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_destination(out: str | Path, source: str, overwrite: bool = False) -> Destination:
    """Whether an export may write `out` (see the module docstring); ConfigError, one
    line naming the folder and what to do, otherwise. Nothing is written here."""
    path = Path(os.path.abspath(os.path.expanduser(str(out))))
    if path == Path(os.path.abspath(source)):
        raise ConfigError(f"the output folder {out} is the source: choose another")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"the output folder {out} is a file: choose a folder")
    holder = holds_checkpoints(str(path))
    if holder:
        raise ConfigError(f"the output folder {out} is {holder} (it holds checkpoints, which "
                          f"generation reads before any export there): export into another "
                          f"folder, e.g. {str(out).rstrip('/')}_hf (--overwrite never "
                          f"replaces one)")
    try:
        held = entries(path) if path.exists() else []
        found = outputs.owner(path) if held else None
    except OSError as err:
        raise ConfigError(f"cannot read the output folder {out}: {err.strerror or err}") from None
    if found in ("corpus", "compile"):
        raise ConfigError(f"the output folder {out} is {outputs.KINDS[found]}, another "
                          f"tool's output (--overwrite never replaces one): export into "
                          f"another folder")
    if not held:
        return Destination(path, (), False)
    if previous_export(path) is not None:
        return Destination(path, tuple(held), True)
    if not overwrite:
        raise ConfigError(f"the output folder {out} holds files that no export of {WRITER} "
                          f"listed in its {MANIFEST} ({_shown(held)}): choose a new or "
                          f"empty folder, or pass --overwrite to replace its contents whole")
    folders = [e for e in held if (path / e).is_dir() and not (path / e).is_symlink()]
    if folders:
        raise ConfigError(f"the output folder {out} holds folders ({_shown(folders)}): "
                          f"--overwrite replaces only a folder of files; choose another")
    return Destination(path, tuple(held), False)


def write(dest: Destination, write_files: Callable[[Path], list[str]],
          record: dict) -> list[str]:
    """Writes an export into `dest`: `write_files(folder)` writes it into a staging folder
    and returns the file names; then the old contents go and the new files (the
    manifest, with `record` in it, last) are renamed in. Returns the files written."""
    created = not dest.path.exists()
    staging = dest.path / STAGING
    try:
        shutil.rmtree(staging, ignore_errors=True)  # an interrupted export's
        staging.mkdir(parents=True)
        files = write_files(staging)
        manifest = {"written_by": WRITER, "files": files, **record}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    except BaseException as err:  # an interrupt too: no half export stays behind
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(dest.path, ignore_errors=True)
        if isinstance(err, OSError):
            raise ConfigError(f"could not write into {dest.path}: "
                              f"{err.strerror or err}") from None
        raise
    try:
        for name in dest.replaces:  # a folder of files (check_destination)
            (dest.path / name).unlink(missing_ok=True)
        for name in [*files, MANIFEST]:
            os.replace(staging / name, dest.path / name)
        staging.rmdir()
    except OSError as err:
        raise ConfigError(f"could not move the export from {staging} into {dest.path}: "
                          f"{err.strerror or err}") from None
    return [*files, MANIFEST]
