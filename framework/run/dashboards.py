"""The dashboards a run's records also go to: W&B (`logging.wandb`) and TensorBoard
(`logging.tensorboard`), sinks of framework/run/tracking.py's `Tracker` (the same
`log(step, metrics)` and `finish(summary)` as metrics.jsonl).
"""

from __future__ import annotations

import time
from pathlib import Path

from framework.config import WandbConfig
from framework.run.tracking import finite_or_none

WANDB_RETRIES = 60  # seconds a restarted run waits for a killed run's W&B service


class WandbSink:
    """One W&B run. Offline mode writes `<run_dir>/wandb/offline-run-*/run-*.wandb`,
    which `wandb sync` uploads later; the resolved config is the run's config.

    A run folder has one W&B run: every invocation in it (a resume, a restart after a
    kill before the first checkpoint) continues the W&B run already there (same id,
    resume="allow"; W&B keeps the history of steps it has already seen). Offline, each
    invocation adds an `offline-run-<time>-<id>` folder of that same id."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, name: str, config: dict):
        import wandb

        previous = previous_wandb_id(run_dir)
        init = lambda: wandb.init(
            mode=cfg.mode, project=cfg.project, entity=cfg.entity, group=cfg.group,
            name=name, dir=str(run_dir), config=config, reinit="finish_previous",
            id=previous, resume="allow" if previous else None,
            settings=wandb.Settings(console="off", silent=True, disable_git=True))
        # After a kill, the killed process's W&B service may hold the run a few seconds
        # more ("run ID ... is in use"), until it sees its parent gone: wait for it.
        for attempt in range(WANDB_RETRIES + 1):
            try:
                self.run = init()
                break
            except Exception as err:  # W&B raises its own error types
                if previous is None or "in use" not in str(err) or attempt == WANDB_RETRIES:
                    raise
                time.sleep(1.0)
        self.dir = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id>
        self._table, self._texts = wandb.Table, {}

    def log(self, step: int, metrics: dict) -> None:
        """Numbers go to the history; text (eval/sample) to a table of (step, text) rows,
        re-logged with every new row (W&B tables are immutable once logged)."""
        row = {}
        for key, value in metrics.items():
            if isinstance(value, str):
                self._texts.setdefault(key, []).append([step, value])
                row[key] = self._table(columns=["step", "text"], data=list(self._texts[key]))
            elif finite_or_none(value) is not None:
                row[key] = value
        self.run.log(row, step=step)

    def finish(self, summary: dict) -> None:
        flat = {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))}
        self.run.summary.update(flat)
        self.run.finish(exit_code=0 if summary.get("status") == "completed" else 1)


class TensorBoardSink:
    """TensorBoard event files in `<run_dir>/tensorboard` (tensorboardX: the event
    format without TensorFlow), from the records metrics.jsonl gets: numbers as
    scalars, text (eval/sample) as text. A resumed run starts a new event file that
    drops the older files' events from the resumed step on (TensorBoard's purge), as
    metrics.jsonl drops its records after the checkpoint."""

    def __init__(self, run_dir: Path, resumed_at: int | None = None):
        from tensorboardX import SummaryWriter

        self.dir = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(str(self.dir), purge_step=resumed_at)

    def log(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, step)
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and (
                    finite_or_none(value) is not None):
                self.writer.add_scalar(key, float(value), step)

    def sync(self) -> None:
        self.writer.flush()

    def finish(self, summary: dict) -> None:
        self.writer.close()


def previous_wandb_id(run_dir: Path) -> str | None:
    """The id of the newest W&B run in run_dir, from its folder's name
    (`wandb/offline-run-<time>-<id>`, `wandb/run-<time>-<id>`), which W&B creates
    first thing: also a run killed before it wrote anything is found."""
    folders = [p for p in Path(run_dir).glob("wandb/*run-*-*") if p.is_dir()]
    newest = max(folders, key=lambda p: (p.name.rsplit("-", 2)[-2], p.stat().st_mtime),
                 default=None)
    return newest.name.rsplit("-", 1)[-1] if newest else None
