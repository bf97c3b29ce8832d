"""Typed configuration: one small dataclass per component.

Each component receives only its own slice (the model gets `ModelConfig`, the
pipeline gets `ParallelConfig`, ...). Hydra (see `framework/run.py`) composes these
same dataclasses, so a misspelled key or a wrong type fails at composition time.

`validate(...)` checks a whole configuration against a device count *before*
anything is compiled and raises `ConfigError` with one line per problem, each naming
the setting and a valid alternative.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Optional

SCHEDULES = ("gpipe", "circular", "1f1b")
REMAT_POLICIES = ("none", "full", "save_dots")
DTYPES = ("float32", "bfloat16")
ATTENTION = ("auto", "dense", "blockwise", "cudnn")  # framework/attention.py


class ConfigError(ValueError):
    """A user error in the configuration. `str(err)` is meant to be shown as is."""


@dataclass
class ModelConfig:
    """A Llama-style decoder. Parameters are float32; `dtype` is the compute dtype."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 352
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "float32"
    attention: str = "auto"  # auto | dense | blockwise | cudnn (framework/attention.py)
    attention_block_q: int = 512  # blockwise: queries per block
    attention_block_kv: int = 512  # blockwise: keys per block

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class ParallelConfig:
    """How the model is laid out on the (pipe, data, tensor) mesh."""

    pipeline: int = 1
    data: int = 1  # -1: all devices left after pipeline x tensor
    tensor: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"  # gpipe | circular | 1f1b
    virtual_stages: int = 1  # layer chunks per pipeline rank (circular only)
    remat: str = "none"  # none | full | save_dots, applied per layer
    zero1: bool = False  # shard optimizer state + master params over `data`
    sequence_parallel: bool = False  # shard norms/residuals along seq over `tensor`

    @property
    def n_devices(self) -> int:
        return self.pipeline * self.data * self.tensor

    @property
    def mesh_name(self) -> str:
        name = f"pp{self.pipeline}-dp{self.data}-tp{self.tensor}-mb{self.microbatches}"
        if self.schedule != "gpipe":
            name += f"-{self.schedule}"
            if self.schedule == "circular":
                name += f"-v{self.virtual_stages}"
        return name


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to `lr * min_lr_ratio`."""

    lr: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    min_lr_ratio: float = 0.1


@dataclass
class TrainConfig:
    seq_len: int = 64
    global_batch_size: int = 16
    steps: int = 100
    seed: int = 0
    resume: str = "auto"  # auto: continue from the newest complete checkpoint | never
    resume_from: Optional[str] = None  # a checkpoint (or checkpoint folder) of another run
    # End this invocation after this step, with a checkpoint (status "stopped"); the LR
    # schedule still spans train.steps, and the same command without it continues.
    stop_at: Optional[int] = None


@dataclass
class DataConfig:
    """Token source. kind: synthetic | markov | text | tokens (see framework/data.py)."""

    kind: str = "synthetic"
    path: Optional[str] = None  # text: a UTF-8 file; tokens: a flat uint16/uint32 file
    token_dtype: str = "uint16"  # tokens: dtype of the binary file
    holdout_fraction: float = 0.05  # share of the data kept out of training for eval/loss
    markov_concentration: float = 0.1  # markov: Dirichlet concentration of each row


@dataclass
class EvalConfig:
    every: int = 0  # steps between eval/loss measurements (0: never)
    batches: int = 2  # held-out batches averaged per evaluation


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints (0: only the final / preemption one)
    keep: int = 3  # newest checkpoints kept on disk
    dir: Optional[str] = None  # default: <run output folder>/checkpoints
    async_save: bool = True


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "framework"
    group: Optional[str] = None  # default: the sweep's name in multirun, else none
    entity: Optional[str] = None
    name: Optional[str] = None  # run name; default: the degrees, e.g. pp2-dp2-tp2-mb8


@dataclass
class LoggingConfig:
    every: int = 10  # steps between logged metrics
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True  # the terminal progress bar


@dataclass
class DevicesConfig:
    platform: str = "auto"  # auto | cpu | gpu | tpu
    local_device_count: Optional[int] = None  # simulated CPU devices per process
    # Refuse, before allocating anything, a run predicted not to fit the devices' memory
    # (framework/memory_check.py); memory_limit_gb replaces the detected limit (GiB/device).
    memory_check: bool = True
    memory_limit_gb: Optional[float] = None


@dataclass
class DistributedConfig:
    """Multi-host (framework/distributed.py): unset for one process, or for one task of
    a multi-task SLURM step (detected); all three for an explicit launch; or
    num_processes=-1 to let jax.distributed.initialize() detect the cluster."""

    coordinator_address: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None  # -1: detect (SLURM, Cloud TPU, Open MPI); 1: never
    process_id: Optional[int] = None


@dataclass
class RunConfig:
    """The whole run, as Hydra composes it. Components receive only their own slice."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


def resolve_data_degree(parallel: ParallelConfig, n_devices: int) -> ParallelConfig:
    """Returns a copy with `data: -1` replaced by the devices left over."""
    if parallel.data != -1:
        return parallel
    rest = parallel.pipeline * parallel.tensor
    if rest < 1 or n_devices % rest:
        raise ConfigError(
            f"parallel.data=-1 cannot fill {n_devices} devices with "
            f"parallel.pipeline*parallel.tensor={rest}: pick pipeline and tensor whose "
            f"product divides {n_devices}"
        )
    return dataclasses.replace(parallel, data=n_devices // rest)


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
    if p.schedule not in SCHEDULES:
        errs.append(f"parallel.schedule={p.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if p.remat not in REMAT_POLICIES:
        errs.append(f"parallel.remat={p.remat!r} is not one of {', '.join(REMAT_POLICIES)}")
    if model.dtype not in DTYPES:
        errs.append(f"model.dtype={model.dtype!r} is not one of {', '.join(DTYPES)}")
    errs += _check_attention(model)
    if n_devices is not None and p.data != -1 and p.n_devices != n_devices:
        errs.append(
            f"parallel.pipeline*data*tensor={p.pipeline}*{p.data}*{p.tensor}={p.n_devices} "
            f"but {n_devices} devices are in use: make the product {n_devices} "
            f"(e.g. parallel.data=-1 fills the remaining devices)"
        )
    n_chunks = p.pipeline * (p.virtual_stages if p.schedule == "circular" else 1)
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
    for name in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        value = getattr(model, name)
        if value % p.tensor:
            errs.append(f"model.{name}={value} is not divisible by parallel.tensor={p.tensor}: "
                        f"use tensor in {{{', '.join(map(str, _divisors(value)))}}}")
    if model.d_model % model.n_heads:
        errs.append(f"model.d_model={model.d_model} is not divisible by model.n_heads="
                    f"{model.n_heads}")
    if model.n_heads % model.n_kv_heads:
        errs.append(f"model.n_heads={model.n_heads} is not divisible by model.n_kv_heads="
                    f"{model.n_kv_heads}: grouped-query attention needs whole groups")
    if model.head_dim % 2:
        errs.append(f"model.d_model/n_heads={model.head_dim} must be even for rotary embeddings")
    if p.sequence_parallel and train.seq_len % p.tensor:
        errs.append(f"train.seq_len={train.seq_len} is not divisible by parallel.tensor="
                    f"{p.tensor}, needed by parallel.sequence_parallel=true")
    if p.schedule == "circular" and p.virtual_stages > 1 and p.microbatches < p.pipeline:
        errs.append(f"parallel.microbatches={p.microbatches} < parallel.pipeline={p.pipeline}: "
                    f"the circular schedule needs microbatches >= pipeline (a microbatch "
                    f"must leave the last rank before the first rank needs it again)")
    if p.schedule != "circular" and p.virtual_stages != 1:
        errs.append(f"parallel.virtual_stages={p.virtual_stages} only applies to "
                    f"parallel.schedule=circular: set it to 1 or use the circular schedule")
    return errs


def _check_attention(model: ModelConfig) -> list[str]:
    if model.attention not in ATTENTION:
        return [f"model.attention={model.attention!r} is not one of {', '.join(ATTENTION)}"]
    errs = [f"model.{name}={getattr(model, name)} must be >= 1"
            for name in ("attention_block_q", "attention_block_kv") if getattr(model, name) < 1]
    if model.attention == "cudnn" and model.dtype not in ("bfloat16",):
        errs.append(f"model.attention=cudnn needs model.dtype=bfloat16 (cuDNN's fused "
                    f"attention has no {model.dtype} kernel): use model.attention=auto, "
                    f"dense or blockwise")
    if model.attention == "cudnn" and model.n_heads and model.d_model % model.n_heads == 0 \
            and (model.head_dim % 8 or model.head_dim > 128):
        errs.append(f"model.attention=cudnn needs d_model/n_heads={model.head_dim} to be a "
                    f"multiple of 8 and at most 128: use model.attention=auto or blockwise")
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
