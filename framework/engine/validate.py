"""Can this (model, parallel, train) configuration be built on these devices? Checked
before anything is compiled: `check` lists every problem, one readable line each
naming the setting and a valid alternative; `validate` raises them as one
`ConfigError` and resolves `parallel.data=-1`.

The rules: degrees >= 1 whose product is the device count; the schedule's own rules
(`framework/parallel/pipeline/schedule.py`); layers divisible into the pipeline's
chunks; the global batch into data replicas x microbatches; every dimension the
tensor-parallel plan splits divisible by `parallel.tensor`; whole grouped-query
heads; an even head dim for RoPE; the attention kernel's constraints.
"""

from __future__ import annotations

import warnings

from framework.config import (TENSOR_SPLITTABLE, ModelConfig, ParallelConfig, TrainConfig,
                              not_one_of)
from framework.errors import ConfigError
from framework.model import attention
from framework.model.llama import check_model
from framework.parallel.mesh import resolve_data_degree
from framework.parallel.pipeline import schedule as schedules

# Model dimensions of each logical axis the tensor-parallel plan can split.
SPLIT_DIMENSION = {"heads": "n_heads", "kv_heads": "n_kv_heads", "mlp": "d_ff",
                   "vocab": "vocab_size"}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
          n_devices: int | None) -> list[str]:
    """All problems with this configuration, one readable line each (empty = valid)."""
    p = parallel
    errs = []
    for name in ("pipeline", "tensor", "microbatches", "virtual_stages"):
        if getattr(p, name) < 1:
            errs.append(f"parallel.{name}={getattr(p, name)} must be >= 1")
    if p.data < 1 and p.data != -1:
        errs.append(f"parallel.data={p.data} must be >= 1, or -1 for all remaining devices")
    if errs:
        return errs  # the checks below divide by these degrees
    errs += schedules.check(p.schedule, p.pipeline, p.microbatches, p.virtual_stages)
    errs += [e for e in (not_one_of("parallel.remat", p.remat),
                         not_one_of("model.dtype", model.dtype)) if e]
    errs += attention.check_settings(model)
    if n_devices is not None and p.data != -1 and p.n_devices != n_devices:
        errs.append(
            f"parallel.pipeline*data*tensor={p.pipeline}*{p.data}*{p.tensor}={p.n_devices} "
            f"but {n_devices} devices are in use: make the product {n_devices} "
            f"(e.g. parallel.data=-1 fills the remaining devices)"
        )
    errs += _check_divisibility(model, p, train)
    errs += check_model(model)
    if p.sequence_parallel and train.seq_len % p.tensor:
        errs.append(f"train.seq_len={train.seq_len} is not divisible by parallel.tensor="
                    f"{p.tensor}, needed by parallel.sequence_parallel=true")
    return errs


def _check_divisibility(model: ModelConfig, p: ParallelConfig, train: TrainConfig) -> list[str]:
    errs = []
    n_chunks = p.pipeline * schedules.chunks_per_rank(p.schedule, p.virtual_stages)
    if model.n_layers % n_chunks:
        what = "parallel.pipeline" if n_chunks == p.pipeline else "parallel.pipeline*virtual_stages"
        ok = [d for d in _divisors(model.n_layers) if d <= 64]
        errs.append(f"model.n_layers={model.n_layers} is not divisible by {what}={n_chunks}: "
                    f"use a divisor of {model.n_layers} ({', '.join(map(str, ok))})")
    if p.data != -1 and train.global_batch_size % (p.data * p.microbatches):
        step = p.data * p.microbatches
        good = max(step, (train.global_batch_size // step) * step)
        errs.append(
            f"train.global_batch_size={train.global_batch_size} is not divisible by "
            f"parallel.data*microbatches={p.data}*{p.microbatches}={step}: "
            f"use a multiple of {step} (e.g. {good})"
        )
    for axis in [a for a in TENSOR_SPLITTABLE if a in p.tensor_split]:
        name = SPLIT_DIMENSION[axis]
        value = getattr(model, name)
        if value % p.tensor:
            errs.append(f"model.{name}={value} is not divisible by parallel.tensor={p.tensor}: "
                        f"use tensor in {{{', '.join(map(str, _divisors(value)))}}}")
    return errs


def validate(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
             n_devices: int | None) -> ParallelConfig:
    """Raises ConfigError listing every problem; returns the parallel config with
    `data: -1` resolved. Warns when microbatches < pipeline (bubble over 50%)."""
    errs = check(model, parallel, train, n_devices)
    if errs:
        raise ConfigError("; ".join(errs))
    if n_devices is not None:
        parallel = resolve_data_degree(parallel, n_devices)
        errs = check(model, parallel, train, n_devices)
        if errs:
            raise ConfigError("; ".join(errs))
    if parallel.microbatches < parallel.pipeline:
        warnings.warn(
            f"parallel.microbatches={parallel.microbatches} < parallel.pipeline="
            f"{parallel.pipeline}: the pipeline bubble will exceed 50%; use microbatches >= "
            f"{4 * parallel.pipeline} to keep it under 20%",
            stacklevel=2,
        )
    return parallel
