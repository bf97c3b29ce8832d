"""One way to write an output, for every tool (tools/prepare_data.py,
tools/train_tokenizer.py, tools/export_hf.py, `python -m framework.compile`) and the
run's own copies.

Writing a file (`replacing`, `write_json`, `copy_file`): the bytes go to a temporary
name in the target's folder (`.partial-<name>.<pid>.<random>`, the same filesystem, so
the rename is atomic), are flushed and fsync'ed, and the temporary file is renamed over
the target; the folder is fsync'ed so that the rename survives a crash. An error or an
interrupt removes the temporary file: the old target, if any, is untouched.

Reading before writing (`refuse_inputs`): an output is never one of the inputs (the
same file, by device and inode after resolving links, or a file inside the output
folder), so no input is ever opened for writing.

Whose folder (`owner`, `check_folder`): a tool writes into a folder that is missing,
empty, or its own kind of output (recognised by what that kind always holds: a corpus's
manifest.json, an export's export_hf.json, a compile report). It never writes into
another tool's output (a training run's folder, a Hugging Face folder, a corpus, a
compile report), even with --overwrite, and into any other folder with files only with
--overwrite. `check_file` does the same for a single-file output.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable

from framework.errors import ConfigError
from framework.io.checkpoint.paths import holds_checkpoints

PARTIAL = ".partial-"  # prefix of the temporary files of a write in progress

# The kinds of output folders and what always marks them (the first match wins: a
# folder holding checkpoints is a run's, whatever else lies in it).
KINDS = {
    "run": "a training run's folder",
    "compile": "a compile report's folder (python -m framework.compile)",
    "hf": "a Hugging Face model folder",
    "corpus": "a prepared corpus (tools/prepare_data.py)",
}


def resolved(path: str | os.PathLike) -> Path:
    """`path` absolute, with ~ and links resolved (a missing tail is kept as given)."""
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: the same device and inode (hard links and
    symbolic links included), or the same resolved path when either is missing."""
    try:
        one, two = os.stat(a), os.stat(b)
        return (one.st_dev, one.st_ino) == (two.st_dev, two.st_ino)
    except OSError:
        return resolved(a) == resolved(b)


def refuse_inputs(output: str, inputs: Iterable[tuple[str, str]], folder: bool) -> None:
    """ConfigError (one line) when an input is the output, or, for a folder output, lies
    inside it. `inputs`: (what the input is, e.g. "--tokenizer", its path)."""
    out = resolved(output)
    for what, path in inputs:
        if same_file(path, output):
            raise ConfigError(f"{what} {path} is the output {output}: writing the output "
                              f"would destroy it; name another output")
        if folder and out in resolved(path).parents:
            raise ConfigError(f"{what} {path} lies inside the output folder {output}, "
                              f"which this tool writes: move it out of that folder first")


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # some filesystems cannot open a folder: the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def replacing(path: str | os.PathLike, mode: str = "wb"):
    """Yields a file open for writing that becomes `path` when the block ends without
    an error (module docstring); on an error or interrupt `path` is untouched."""
    path = Path(path)
    tmp = path.with_name(f"{PARTIAL}{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def write_json(path: str | os.PathLike, data, indent: int = 2) -> None:
    with replacing(path, "w") as f:
        json.dump(data, f, indent=indent)
        f.write("\n")


def copy_file(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """`source`'s bytes as `target`, atomically; nothing when they are one file."""
    if same_file(source, target):
        return
    with open(source, "rb") as src, replacing(target) as dst:
        shutil.copyfileobj(src, dst)


def sweep_partials(folder: str | os.PathLike) -> None:
    """Removes the temporary files an interrupted write left in `folder`."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(PARTIAL):
            Path(folder, name).unlink(missing_ok=True)


def entries(folder: str | os.PathLike) -> list[str]:
    """The folder's entries, without temporary files of interrupted writes."""
    return sorted(e for e in os.listdir(folder) if not e.startswith(PARTIAL))


def _summary_status(folder: Path) -> str | None:
    try:
        return json.loads((folder / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


COMPILE_STATUSES = ("compiled", "does_not_fit")  # summary.json of a compile report
# A corpus in the making (framework/io/prepare.py): shards, or an input's done-marker.
CORPUS_FILES = re.compile(r"shard-\d{5}-\d{3}\.(bin|idx)|input-\d{5}\.done")


def owner(folder: str | os.PathLike) -> str | None:
    """Which kind of output a folder is (a key of KINDS), or None for none of them. A
    lock alone does not say: a live one refuses at `runlock.acquire`."""
    folder = Path(folder)
    status = _summary_status(folder)
    if status in COMPILE_STATUSES or (
            (folder / "compile_report.json").is_file() and status is None):
        return "compile"
    if holds_checkpoints(str(folder)) or (folder / "metrics.jsonl").exists():
        return "run"
    if (folder / "export_hf.json").is_file() or (folder / "config.json").is_file():
        return "hf"
    if (folder / "manifest.json").is_file() or any(
            CORPUS_FILES.fullmatch(n) for n in entries(folder)):
        return "corpus"
    return None


def check_folder(out: str, kind: str, overwrite: bool,
                 own: Callable[[Path], bool] | None = None) -> str:
    """Whether a tool that writes outputs of `kind` may write into the folder `out`:
    "new" (missing or empty), "own" (its own kind: `own(folder)` if given, else
    `owner`), "overwrite" (other files, and --overwrite); ConfigError otherwise."""
    path = resolved(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"the output {out} is a file, not a folder: name a new or empty "
                          f"folder (or one this tool wrote before)")
    if not path.exists():
        if not path.parent.is_dir():
            _missing_parent(out, path)
        return "new"
    try:
        held = entries(path)
        found = owner(path) if held else None
    except OSError as err:
        raise ConfigError(f"cannot read the output folder {out}: {err.strerror or err}") from None
    if not held:
        return "new"
    if (own(path) if own is not None else found == kind):
        return "own"
    if found is not None and found != kind:
        raise ConfigError(f"the output folder {out} is {KINDS[found]}, another tool's "
                          f"output: writing into it would replace its files (--overwrite "
                          f"never does); choose another folder")
    if not overwrite:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ConfigError(f"the output folder {out} holds files that are not "
                          f"{KINDS.get(kind, kind)} ({shown}): choose a new or empty "
                          f"folder, or pass --overwrite")
    return "overwrite"


def _missing_parent(out: str, path: Path) -> None:
    existing = next(p for p in path.parents if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"the output {out} cannot be created: {existing} is a file, "
                          f"not a folder")


def check_file(out: str, what: str, overwrite: bool, own: Callable[[Path], bool]) -> bool:
    """Whether a tool may write the file `out` (`what` it writes, in words): its folder
    exists, and `out` is missing, a file `own` recognises as this tool's, or --overwrite
    is given. Returns whether a file is replaced; ConfigError (one line) otherwise."""
    path = resolved(out)
    if path.is_dir():
        raise ConfigError(f"the output {out} is a folder: name the file to write "
                          f"(e.g. {os.path.join(out, 'tokenizer.json')})")
    if not path.parent.is_dir():
        raise ConfigError(f"the output {out} cannot be written: its folder {path.parent} "
                          f"does not exist (create it first)")
    if not path.exists():
        return False
    if not overwrite and not own(path):
        raise ConfigError(f"the output {out} exists and is not {what}: name a new file, or "
                          f"pass --overwrite to replace it")
    return True
