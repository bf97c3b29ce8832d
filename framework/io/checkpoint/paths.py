"""What a path given by the user holds, checkpoint-wise: a run folder, a checkpoint
folder (Orbax step folders `<step>/`) or one step folder of one. Every command that
takes such a path (`train.resume_from`, `framework.generate checkpoint=`,
`tools/export_hf.py`) reads it through `locate`.

    <run>/                    its checkpoint folder: summary.json's `checkpoint_dir`
                              (where `checkpoint.dir` put them), else <run>/checkpoints
    <run>/checkpoints/        the newest complete step in it
    <run>/checkpoints/<step>/ that step
Remote paths (gs://...) are kept as given: a folder, or a step folder by its number.

`holds_checkpoints` says whether a local folder is one of these three (a run folder
counts even before its first save): such a folder is read as checkpoints even when a
Hugging Face config.json lies in it too, and tools/export_hf.py never writes into one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from framework.errors import ConfigError

RUN_CHECKPOINTS = "checkpoints"  # a run folder's checkpoint folder
STATE, METADATA = "state", "metadata"  # the two items of every checkpoint step
# Written by Orbax (the step's own metadata) and by us, inside the atomic step folder:
# a step folder missing either (e.g. copied by hand, or half-written on a filesystem
# without atomic rename) is never picked.
COMPLETE_MARKERS = ("_CHECKPOINT_METADATA", os.path.join(METADATA, "metadata"))


@dataclass(frozen=True)
class Located:
    folder: str  # the checkpoint folder (absolute, or remote)
    step: int | None  # the step named by the path, or None for the newest complete one
    run_dir: str | None  # the run folder it belongs to, where known


def absolute(path: str) -> str:
    """A path as recorded in checkpoints and summaries: absolute (remote: as given)."""
    if "://" in path:
        return path.rstrip("/")
    return os.path.abspath(os.path.expanduser(path)).rstrip(os.sep)


def locate(path: str) -> Located | None:
    """The checkpoint folder and step a path names (see the module docstring), or None
    when it is none of these."""
    if "://" in path:
        head, _, name = path.rstrip("/").rpartition("/")
        return Located(head, int(name), None) if name.isdigit() else Located(
            path.rstrip("/"), None, None)
    path = absolute(path)
    parent, name = os.path.split(path)
    if name.isdigit() and os.path.isdir(parent) and (_looks_like_step(path)
                                                      or not os.path.exists(path)):
        return Located(parent, int(name), os.path.dirname(parent))
    if not os.path.isdir(path):
        return None
    if _is_run_folder(path):
        return Located(_run_checkpoints(path), None, path)
    return Located(path, None, parent)


def _looks_like_step(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, m)) for m in (STATE, *COMPLETE_MARKERS))


def _is_run_folder(path: str) -> bool:
    """summary.json is written when a run starts, checkpoints/ at its first save."""
    return os.path.exists(os.path.join(path, "summary.json")) or \
        os.path.isdir(os.path.join(path, RUN_CHECKPOINTS))


def holds_checkpoints(path: str) -> str | None:
    """What a local folder is checkpoint-wise, in words ("a run folder", "a checkpoint
    folder", "a checkpoint step folder"), or None when it is none of these."""
    path = absolute(path)
    if not os.path.isdir(path):
        return None
    if _is_run_folder(path):
        return "a run folder"
    if os.path.basename(path).isdigit() and _looks_like_step(path):
        return "a checkpoint step folder"
    try:
        with os.scandir(path) as entries:
            if any(e.name.isdigit() and e.is_dir() and _looks_like_step(e.path)
                   for e in entries):
                return "a checkpoint folder"
    except OSError as err:  # unreadable: one line, not a traceback
        raise ConfigError(f"cannot read {path}: {err.strerror or err}") from None
    return None


def _run_checkpoints(run_dir: str) -> str:
    """The run folder's own checkpoints/ (also in a copied or moved run folder), else the
    checkpoint.dir its summary.json records."""
    own = os.path.join(run_dir, RUN_CHECKPOINTS)
    if os.path.isdir(own):
        return own
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            recorded = json.load(f).get("checkpoint_dir")
    except (OSError, ValueError, AttributeError):
        recorded = None
    return recorded or own
