"""The valid range of every numeric setting (`RANGES`) and the check that reads them.

Part of `framework.config` (import them from there).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """Valid values of a numeric setting: low/high bounds (None: unbounded), each
    inclusive unless marked open. None values (optional settings) are always valid."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def text(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")

    def problem(self, key: str, value) -> str | None:
        if value is None or isinstance(value, bool):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key}={value} must be a finite number {self.text()}"
        too_low = self.low is not None and (value <= self.low if self.low_open
                                            else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open
                                              else value > self.high)
        return f"{key}={value} must be {self.text()}" if too_low or too_high else None


AT_LEAST_1, AT_LEAST_0, POSITIVE = Range(1), Range(0), Range(0, low_open=True)
FRACTION_BELOW_1 = Range(0, 1, high_open=True)
# Every numeric setting outside `parallel` (whose degrees framework/engine/validate.py
# checks) and `distributed` (framework/runtime/distributed.py). New numeric settings
# belong here too.
RANGES: dict[str, Range] = {
    "model.vocab_size": AT_LEAST_1, "model.d_model": AT_LEAST_1,
    "model.n_layers": AT_LEAST_1, "model.n_heads": AT_LEAST_1,
    "model.n_kv_heads": AT_LEAST_1, "model.d_ff": AT_LEAST_1,
    "model.rope_theta": POSITIVE, "model.norm_eps": POSITIVE,
    "model.explicit_head_dim": AT_LEAST_1, "model.sliding_window": AT_LEAST_1,
    "model.sliding_window_pattern": AT_LEAST_0, "model.query_pre_attn_scalar": POSITIVE,
    "model.attn_softcap": POSITIVE, "model.final_softcap": POSITIVE,
    "model.loss_chunk": AT_LEAST_0,
    "optim.lr": AT_LEAST_0, "optim.warmup_steps": AT_LEAST_0,
    "optim.weight_decay": AT_LEAST_0,
    "optim.grad_clip": AT_LEAST_0,  # 0: no clipping
    "optim.b1": FRACTION_BELOW_1, "optim.b2": FRACTION_BELOW_1, "optim.eps": POSITIVE,
    "optim.min_lr_ratio": Range(0, 1), "optim.z_loss": AT_LEAST_0,
    "optim.decay_steps": AT_LEAST_1, "optim.muon_momentum": FRACTION_BELOW_1,
    "train.seq_len": AT_LEAST_1, "train.global_batch_size": AT_LEAST_1,
    "train.steps": AT_LEAST_1,
    "train.seed": Range(0, 2**32 - 1),  # JAX keys hold 32 bits; numpy needs >= 0
    "train.stop_at": AT_LEAST_1,
    "data.holdout_fraction": FRACTION_BELOW_1, "data.markov_concentration": POSITIVE,
    "data.prefetch": AT_LEAST_0,
    "eval.every": AT_LEAST_0, "eval.batches": AT_LEAST_1, "eval.sample_tokens": AT_LEAST_1,
    "checkpoint.every": AT_LEAST_0, "checkpoint.keep": AT_LEAST_1,
    "logging.every": AT_LEAST_1,
    "devices.local_device_count": AT_LEAST_1,
    "profile.steps": AT_LEAST_0, "profile.start_step": Range(2, None),
    "profile.keep_trace_mb": AT_LEAST_0,
}


def check_ranges(cfg) -> list[str]:
    """Every numeric setting of a RunConfig outside its range (one line each, naming the
    setting and what is valid), plus the relations between them; empty when all are
    valid."""
    errs = []
    for key, valid in RANGES.items():
        section, name = key.split(".")
        holder = getattr(cfg, section, None)
        if holder is not None and hasattr(holder, name):
            problem = valid.problem(key, getattr(holder, name))
            if problem:
                errs.append(problem)
    return errs


def setting_names(cls, prefix: str = "") -> list[str]:
    """Every leaf setting of a config dataclass, as its dotted name (e.g. train.steps)."""
    import typing

    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, name = hints[f.name], prefix + f.name
        out += setting_names(kind, name + ".") if dataclasses.is_dataclass(kind) else [name]
    return out
