"""Where a run's records go besides summary.json (`make_tracker`): metrics.jsonl, the
progress bar, W&B (framework/run/tracking.py) and TensorBoard event files
(`logging.tensorboard=true`, `TensorBoardSink`)."""

from __future__ import annotations

import errno
from pathlib import Path

from framework.config import RunConfig
from framework.errors import ConfigError
from framework.run.tracking import (JsonlSink, ProgressBar, Tracker, WandbSink, _clean,
                                    read_metrics)


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


def make_tracker(cfg: RunConfig, run_dir: Path, run_config: dict, base: dict,
                 primary: bool, resumed_at: int | None, start: int) -> Tracker:
    """Process 0: metrics.jsonl, progress bar, W&B, summary.json. Others: nothing."""
    if not primary:
        return Tracker(run_dir, [], base, write=False)
    sinks = [JsonlSink(run_dir, resumed_at)]
    if sinks[0].kept_aside is not None:  # records that would otherwise be lost
        print(f"the earlier {sinks[0].path.name} is kept as {sinks[0].kept_aside}",
              flush=True)
    if start >= cfg.train.steps:  # nothing to train: keep the last record's numbers
        records = read_metrics(run_dir) if resumed_at is not None else []
        return Tracker(run_dir, sinks, {**base, **(records[-1] if records else {})})
    if cfg.logging.progress:
        sinks.append(ProgressBar(cfg.train.steps, first=start))
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(run_dir, resumed_at))
    if cfg.logging.wandb.mode != "disabled":
        wandb_sink = WandbSink(cfg.logging.wandb, run_dir, base["run_name"], run_config)
        base = {**base, "wandb_dir": str(wandb_sink.dir)}
        sinks.append(wandb_sink)
    return Tracker(run_dir, sinks, base)
