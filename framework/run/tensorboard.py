"""TensorBoard event files of a run (`logging.tensorboard=true`), from the records
metrics.jsonl gets (framework/run/tracking.py)."""

from __future__ import annotations

import errno
from pathlib import Path

from framework.errors import ConfigError
from framework.run.tracking import _clean


class TensorBoardSink:
    """TensorBoard event files in `<run_dir>/tensorboard` (tensorboardX: the event
    format without TensorFlow), from the records metrics.jsonl gets: numbers as
    scalars, text (eval/sample) as text. A resumed run starts a new event file that
    drops the older files' events from the resumed step on (TensorBoard's purge), as
    metrics.jsonl drops its records after the checkpoint."""

    def __init__(self, run_dir: Path, resumed_at: int | None = None):
        from tensorboardX import SummaryWriter

        self.dir = Path(run_dir) / "tensorboard"
        try:
            if self.dir.exists() and not self.dir.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "a file, not a folder", str(self.dir))
            self.writer = SummaryWriter(str(self.dir), purge_step=resumed_at)
        except OSError as err:
            raise ConfigError(f"logging.tensorboard=true writes {self.dir}, which cannot be "
                              f"used ({err.strerror or err}): move it aside, or set "
                              f"logging.tensorboard=false") from None

    def log(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, step)
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and (
                    _clean(value) is not None):
                self.writer.add_scalar(key, float(value), step)

    def sync(self) -> None:
        self.writer.flush()

    def finish(self, summary: dict) -> None:
        self.writer.close()
