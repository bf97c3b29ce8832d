"""Every error a user of the framework can be shown, in one place.

Each carries a message meant to be printed as it is: one line, naming the setting, the
file or the step involved, and what would work instead. The command lines turn them
into an exit status (`framework/run/cli.py`):

    ConfigError          2  bad settings, a folder another run holds, a run that will
                            not fit; raised before anything is compiled
    Diverged             3  a non-finite loss or gradient norm
    StorageError         4  a checkpoint or a record could not be written
The others are handled where they occur: a DamagedCheckpoint makes a run fall back to
the previous checkpoint, a NonFiniteStateError becomes Diverged, a PlanError is a
ConfigError of the tensor-parallel rules.
"""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A user error in the configuration. `str(err)` is meant to be shown as is."""


class PlanError(ConfigError):
    """The tensor-parallel rules ask for a layout the model cannot run."""


class MemoryCheckError(ConfigError):
    """The run is predicted not to fit its devices; the message says what would."""


class FolderBusy(ConfigError):
    """Another live run holds the folder."""


class StorageError(RuntimeError):
    """A checkpoint or a record could not be written (no space, permission, quota).
    `str(err)` is one line: what failed, where, the size needed, the newest good
    checkpoint."""


class DataError(RuntimeError):
    """Training data damaged or changed after the run started (a shard truncated or
    rewritten). `str(err)` is one line: the file and what is wrong with it."""


class Diverged(RuntimeError):
    """A non-finite loss or gradient norm (or train state) at `step`."""

    def __init__(self, step: int, message: str):
        self.step = step
        super().__init__(message)

    @classmethod
    def from_values(cls, step: int, values: dict) -> "Diverged":
        bad = [k for k, v in values.items() if not math.isfinite(v)]
        shown = ", ".join(f"{k}={v:.4g}" for k, v in values.items())
        what = {"weight": "a layer weight", "activation": "a layer matmul's input",
                "gradient": "a layer matmul's output gradient"}
        fp8 = [what[k[4:].split("_")[0]] for k in bad if k.startswith("fp8/")]
        why = f"; {fp8[0]} the FP8 matmuls quantize is not finite (and so its scale)" \
            if fp8 else ""
        return cls(step, f"non-finite {' and '.join(bad)} at step {step} ({shown}){why}")


class NonFiniteStateError(ValueError):
    """A train state with NaN/inf values was about to be checkpointed."""


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be restored as saved: unreadable, incomplete, or with
    arrays whose fingerprints differ. `str(err)` is one line."""

    def __init__(self, directory: str, step: int, reason: str):
        self.directory, self.step, self.reason = directory, step, reason
        super().__init__(f"the checkpoint of step {step} in {directory} is damaged: {reason}")
