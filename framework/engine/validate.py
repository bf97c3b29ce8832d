"""Can this (model, parallel, train) configuration be built on these devices? Checked
before anything is compiled: `check` lists every problem, one readable line each
naming the setting and a valid alternative; `validate` raises them as one
`ConfigError` and resolves `parallel.data=-1`.

The rules: degrees >= 1 whose product is the device count; the schedule's own rules
(`framework/parallel/pipeline/schedule.py`); layers divisible into the pipeline's
chunks (or `parallel.stage_layers` as layers per stage); the global batch into data replicas x microbatches; every dimension the
tensor-parallel plan splits divisible by `parallel.tensor`; whole grouped-query
heads; an even head dim for RoPE; the attention kernel's constraints.
"""

from __future__ import annotations

import dataclasses
import warnings

from framework.config import (TENSOR_SPLITTABLE, ModelConfig, ParallelConfig, TrainConfig,
                              not_one_of, shown)
from framework.errors import ConfigError
from framework.model import attention, fp8, moe
from framework.engine.resolved import (Layout, global_stages, overlapped, resolved,
                                      with_stage_layers)
from framework.model.prefix import stack_layers, stacked_layers_named
from framework.model.registry import spec_of
from framework.parallel.mesh import resolve_data_degree
from framework.parallel.expert import EXCHANGES
from framework.parallel.pipeline import schedule as schedules
from framework.parallel.pipeline.program import program

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
    for name in ("pipeline", "tensor", "context", "microbatches", "virtual_stages"):
        if getattr(p, name) < 1:
            errs.append(f"parallel.{name}={getattr(p, name)} must be >= 1")
    if p.data < 1 and p.data != -1:
        errs.append(f"parallel.data={p.data} must be >= 1, or -1 for all remaining devices")
    if errs:
        return errs  # the checks below divide by these degrees
    errs += schedules.check(p.schedule, p.pipeline, p.microbatches, p.virtual_stages)
    errs += [e for e in (not_one_of("parallel.remat", p.remat),
                         not_one_of("parallel.fsdp_regather", p.fsdp_regather),
                         not_one_of("model.dtype", model.dtype)) if e]
    errs += attention.check_settings(model) + fp8.check_settings(model)
    if n_devices is not None and p.data != -1 and p.n_devices != n_devices:
        errs.append(
            f"parallel.pipeline*data*context*tensor={p.pipeline}*{p.data}*{p.context}*"
            f"{p.tensor}={p.n_devices} "
            f"but {n_devices} devices are in use: make the product {n_devices} "
            f"(e.g. parallel.data=-1 fills the remaining devices)"
        )
    errs += _check_divisibility(model, p, train)
    errs += spec_of(model).check(model)
    if p.collective_matmul and not p.sequence_parallel:
        errs.append("parallel.collective_matmul=true needs parallel.sequence_parallel=true "
                    "(its rings replace sequence parallelism's all-gather and "
                    "reduce-scatter)")
    errs += _check_sequence_split(p, train)
    errs += _check_expert(model, p)
    return errs + check_combined(p)


def combined_where_possible(p: ParallelConfig) -> ParallelConfig:
    """`p` with `parallel.combined_1f1b` kept only where its table can run combined: the
    setting carried over to other schedules (the planner's layouts, mock_gpu's)."""
    return dataclasses.replace(p, combined_1f1b=False) if check_combined(p) else p


def check_combined(p: ParallelConfig) -> list[str]:
    """parallel.combined_1f1b: the Program says which tables can run combined."""
    if not p.combined_1f1b or schedules.check(p.schedule, p.pipeline, p.microbatches,
                                             p.virtual_stages):
        return []
    try:
        program(p.schedule, p.pipeline, p.microbatches, p.virtual_stages, overlapped(p),
                combined=True)
    except ValueError as e:
        return [str(e)]
    return []


def _check_expert(model: ModelConfig, p: ParallelConfig) -> list[str]:
    """Expert parallelism (framework/parallel/expert.py): a degree that divides the
    data replicas and the experts, with a MoE model. A capacity factor's slots count
    each sequence's copies in token order, which a context split would cut."""
    if model.moe.capacity_factor is not None and p.context > 1:
        return [f"model.moe.capacity_factor={model.moe.capacity_factor} does not run with "
                f"parallel.context={p.context} (slots are counted over whole sequences): "
                f"use model.moe.capacity_factor=null (dropless) or parallel.context=1"]
    if p.expert_chunks < 1:
        return [f"parallel.expert_chunks={p.expert_chunks} must be >= 1 (1: the slots "
                f"exchanged at once)"]
    if p.expert_exchange not in EXCHANGES:
        return [f"parallel.expert_exchange={p.expert_exchange!r} is not one of "
                f"{', '.join(EXCHANGES)}"]
    e = p.expert
    if e < 1:
        return [f"parallel.expert={e} must be >= 1 (1: no expert parallelism)"]
    if e == 1:
        return []
    if model.fp8 == "tensorwise":  # (a device's slots after the exchange mix the data
        # replicas' tokens: their current scale would not be one replica's microbatch's)
        return [f"model.fp8=tensorwise does not run with parallel.expert={e} (the "
                f"experts' inputs, exchanged, mix the data replicas' tokens, so their "
                f"current scale would depend on the layout): use model.fp8=delayed "
                f"(scales from earlier steps') or parallel.expert=1"]
    if not model.moe.enabled:
        return [f"parallel.expert={e} needs a mixture-of-experts model (model.moe.experts "
                f">= 1, e.g. model.family=qwen3_moe): use parallel.expert=1"]
    errs = []
    if model.moe.experts % e:
        errs.append(f"model.moe.experts={model.moe.experts} is not divisible by "
                    f"parallel.expert={e}: use expert in "
                    f"{{{', '.join(map(str, _divisors(model.moe.experts)))}}}")
    if p.data != -1 and p.data % e:
        errs.append(f"parallel.expert={e} does not divide parallel.data={p.data} (the "
                    f"expert devices are carved out of the data replicas): use expert in "
                    f"{{{', '.join(map(str, _divisors(p.data)))}}}")
    return errs


def _check_sequence_split(p: ParallelConfig, train: TrainConfig) -> list[str]:
    """The sequence's splits: 2 x context mirrored chunks (framework/parallel/context.py),
    each device's tokens over `tensor` with sequence parallelism."""
    if p.context > 1 and train.seq_len % (2 * p.context):
        return [f"train.seq_len={train.seq_len} is not divisible by 2 x parallel.context="
                f"{2 * p.context} (each context device holds two mirrored chunks of the "
                f"sequence): pick a context degree c with seq_len divisible by 2c"]
    local = train.seq_len // p.context
    if p.sequence_parallel and local % p.tensor:
        per = f"train.seq_len/parallel.context={local}" if p.context > 1 else \
            f"train.seq_len={train.seq_len}"
        return [f"{per} is not divisible by parallel.tensor={p.tensor}, needed by "
                f"parallel.sequence_parallel=true"]
    return []


def _check_stage_layers(model: ModelConfig, p: ParallelConfig) -> list[str]:
    """Layers per global stage: even (stage_layers null), explicit, or auto."""
    n_chunks = global_stages(p)
    what = "parallel.pipeline" if n_chunks == p.pipeline else "parallel.pipeline*chunks per rank"
    given, L = p.stage_layers, stack_layers(model)
    layers = stacked_layers_named(model)  # the stages' layers (units: prefix.py)
    if given is None:
        if L % n_chunks == 0:
            return []
        ok = [d for d in _divisors(L) if d <= 64]
        return [f"{layers} is not divisible by {what}={n_chunks}: use a divisor of "
                f"{L} ({', '.join(map(str, ok))}) or parallel.stage_layers=auto (uneven stages)"]
    if given == "auto":
        return [] if L >= n_chunks else [
            f"parallel.stage_layers=auto needs {layers} >= {what}={n_chunks} "
            f"(one layer per stage at least)"]
    # A tuple of positive layer counts: ParallelConfig refuses any other form (framework/config/).
    if len(given) != n_chunks:
        return [f"parallel.stage_layers={shown(given)} has {len(given)} stages but "
                f"{what}={n_chunks}: give {n_chunks} layer counts, or auto"]
    if sum(given) != L:
        return [f"parallel.stage_layers={shown(given)} adds up to {sum(given)} layers but "
                f"{layers}"]
    return []


def _check_divisibility(model: ModelConfig, p: ParallelConfig, train: TrainConfig) -> list[str]:
    errs = _check_stage_layers(model, p)
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
    if "mlp" in p.tensor_split and model.moe.enabled:  # the experts' and shared widths
        for name, value in (("expert_hidden", moe.expert_hidden(model)),
                            ("shared_hidden", moe.shared_hidden(model))):
            if value % p.tensor:
                errs.append(f"model.moe.{name} (width {value}) is not divisible by "
                            f"parallel.tensor={p.tensor}: use tensor in "
                            f"{{{', '.join(map(str, _divisors(value)))}}}")
    return errs


def validate(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
             n_devices: int | None) -> ParallelConfig:
    """Raises ConfigError listing every problem; returns the parallel config with
    `data: -1` resolved. Warns when microbatches < pipeline (bubble over 50%)."""
    errs = check(model, parallel, train, n_devices)
    if errs:
        raise ConfigError("; ".join(errs))
    parallel = with_stage_layers(model, parallel, train.seq_len)
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


def resolve(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
            n_devices: int | None) -> Layout:
    """`validate`, then the configuration's Layout (framework/engine/resolved.py): what
    the engine and the analyses read of it."""
    return resolved(model, validate(model, parallel, train, n_devices), train.seq_len,
                    train.global_batch_size)


def check_platform(model: ModelConfig, platform: str) -> None:
    """One-line ConfigErrors for what the model cannot run on `platform` (the attention
    kernel, FP8), checked once the devices are known, before anything is compiled. FP8
    on CPUs runs emulated, slowly: said once."""
    attention.check_platform(model, platform)
    fp8.check_platform(model, platform, moe.fp8_dims(model))
    if model.fp8 != "none" and platform == "cpu":
        warnings.warn("model.fp8 on CPUs is emulated (slow): its numbers are those of a "
                      "GPU's FP8 GEMMs, its speed is not", stacklevel=2)

