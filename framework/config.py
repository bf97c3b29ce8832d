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
import math
import warnings
from dataclasses import dataclass, field
from typing import Optional

from framework.pipeline import schedule as schedules

REMAT_POLICIES = ("none", "full", "save_dots")
DTYPES = ("float32", "bfloat16")
ATTENTION = ("auto", "dense", "blockwise", "cudnn")  # framework/attention.py


class ConfigError(ValueError):
    """A user error in the configuration. `str(err)` is meant to be shown as is."""


ROPE_TYPES = ("none", "llama3")


@dataclass
class RopeScaling:
    """RoPE frequency scaling. rope_type none: plain RoPE (the other fields unused).
    llama3 (`rope_type: llama3` in Hugging Face configs): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are stretched `factor` times,
    those shorter than .../high_freq_factor are kept, and the band between is
    interpolated (Llama 3, Dubey et al. 2024; framework/model.py)."""

    rope_type: str = "none"  # none | llama3
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "float32"
    attention: str = "auto"  # auto | dense | blockwise | cudnn (framework/attention.py)
    attention_block_q: int = 512  # blockwise: queries per block
    attention_block_kv: int = 512  # blockwise: keys per block

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def model_config_from_dict(values: dict) -> ModelConfig:
    """A ModelConfig from `dataclasses.asdict` output (checkpoint metadata); keys it
    does not know are ignored, missing ones take their defaults (older checkpoints)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kept = {k: v for k, v in values.items() if k in names}
    scaling = kept.pop("rope_scaling", None)
    if isinstance(scaling, dict):
        kept["rope_scaling"] = RopeScaling(**scaling)
    return ModelConfig(**kept)


@dataclass
class ParallelConfig:
    """How the model is laid out on the (pipe, data, tensor) mesh."""

    pipeline: int = 1
    data: int = 1  # -1: all devices left after pipeline x tensor
    tensor: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"  # gpipe | circular | 1f1b | interleaved_1f1b | zb_h1
    virtual_stages: int = 1  # layer chunks per pipeline rank (circular, interleaved_1f1b)
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
            if schedules.uses_virtual_stages(self.schedule):
                name += f"-v{self.virtual_stages}"
        return name


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to `lr * min_lr_ratio`."""

    lr: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1  # decoupled (AdamW); never applied to norm scales
    decay_embeddings: bool = True  # also decay the embedding table (nanoGPT, Megatron-LM do)
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
    # A Hugging Face Llama folder (config.json + safetensors): start at step 0 from its
    # weights; the model settings are read from its config.json (framework/hf.py).
    init_from: Optional[str] = None


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
    sample_prompt: Optional[str] = None  # at each evaluation, continue this text (greedy)
    sample_tokens: int = 32  # tokens generated for that sample


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
class ProfileConfig:
    """Steps traced with jax.profiler to time the pipeline bubble (framework/profiling.py)."""

    steps: int = 2  # steps traced (0: no profile)
    start_step: int = 3  # the first traced step (moved earlier, not before a run's 2nd, if needed)
    keep_trace_mb: float = 50.0  # keep the raw trace in <run>/profile if at most this size


@dataclass
class DistributedConfig:
    """Multi-host (framework/distributed.py): unset for one process, or for one task of
    a multi-task SLURM step (detected); all three for an explicit launch; or
    num_processes=-1 to let jax.distributed.initialize() detect the cluster."""

    coordinator_address: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None  # -1: detect (SLURM, Cloud TPU, Open MPI); 1: never
    process_id: Optional[int] = None


@dataclass
class GenerateConfig:
    """`python -m framework.generate key=value ...` (framework/generate.py)."""

    checkpoint: Optional[str] = None  # a run folder, a checkpoint folder or a HF folder
    prompt: str = ""
    prompt_ids: Optional[str] = None  # comma-separated token ids, instead of `prompt`
    max_new_tokens: int = 64
    temperature: float = 0.8  # 0: greedy
    top_k: int = 50  # keep the k most likely tokens (0: all)
    top_p: float = 0.95  # then the smallest set with this much probability (1: all)
    seed: int = 0
    print_ids: bool = False  # also print the prompt's and the continuation's token ids
    tensor: int = 1  # tensor-parallel degree (devices used)
    step: Optional[int] = None  # which checkpoint step (default: the newest complete one)
    stop_at_eos: bool = True  # stop at the model's end-of-sequence token, when known
    platform: str = "auto"  # auto | cpu | gpu | tpu
    dtype: Optional[str] = None  # compute dtype (default: the model's)


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
    profile: ProfileConfig = field(default_factory=ProfileConfig)


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
# Every numeric setting outside `parallel` (whose degrees `check` covers) and
# `distributed` (framework/distributed.py). New numeric settings belong here too.
RANGES: dict[str, Range] = {
    "model.vocab_size": AT_LEAST_1, "model.d_model": AT_LEAST_1,
    "model.n_layers": AT_LEAST_1, "model.n_heads": AT_LEAST_1,
    "model.n_kv_heads": AT_LEAST_1, "model.d_ff": AT_LEAST_1,
    "model.rope_theta": POSITIVE, "model.norm_eps": POSITIVE,
    "optim.lr": AT_LEAST_0, "optim.warmup_steps": AT_LEAST_0,
    "optim.weight_decay": AT_LEAST_0,
    "optim.grad_clip": AT_LEAST_0,  # 0: no clipping
    "optim.b1": FRACTION_BELOW_1, "optim.b2": FRACTION_BELOW_1, "optim.eps": POSITIVE,
    "optim.min_lr_ratio": Range(0, 1),
    "train.seq_len": AT_LEAST_1, "train.global_batch_size": AT_LEAST_1,
    "train.steps": AT_LEAST_1,
    "train.seed": Range(0, 2**32 - 1),  # JAX keys hold 32 bits; numpy needs >= 0
    "train.stop_at": AT_LEAST_1,
    "data.holdout_fraction": FRACTION_BELOW_1, "data.markov_concentration": POSITIVE,
    "eval.every": AT_LEAST_0, "eval.batches": AT_LEAST_1, "eval.sample_tokens": AT_LEAST_1,
    "checkpoint.every": AT_LEAST_0, "checkpoint.keep": AT_LEAST_1,
    "logging.every": AT_LEAST_1,
    "devices.local_device_count": AT_LEAST_1,
    "profile.steps": AT_LEAST_0, "profile.start_step": Range(2, None),
    "profile.keep_trace_mb": AT_LEAST_0,
}


def check_ranges(cfg: "RunConfig") -> list[str]:
    """Every numeric setting outside its range (one line each, naming the setting and
    what is valid), plus the relations between them; empty when all are valid."""
    errs = []
    for key, valid in RANGES.items():
        section, name = key.split(".")
        holder = getattr(cfg, section, None)
        if holder is not None and hasattr(holder, name):
            problem = valid.problem(key, getattr(holder, name))
            if problem:
                errs.append(problem)
    warmup, steps = cfg.optim.warmup_steps, cfg.train.steps
    if not errs and warmup > steps:
        errs.append(f"optim.warmup_steps={warmup} is more than train.steps={steps}: the "
                    f"learning rate would never reach optim.lr; use at most {steps}")
    return errs


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
    errs += schedules.check(p.schedule, p.pipeline, p.microbatches, p.virtual_stages)
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
    errs.extend(check_rope_scaling(model.rope_scaling))
    if p.sequence_parallel and train.seq_len % p.tensor:
        errs.append(f"train.seq_len={train.seq_len} is not divisible by parallel.tensor="
                    f"{p.tensor}, needed by parallel.sequence_parallel=true")
    return errs


def check_rope_scaling(r: RopeScaling) -> list[str]:
    if r.rope_type not in ROPE_TYPES:
        return [f"model.rope_scaling.rope_type={r.rope_type!r} is not one of "
                f"{', '.join(ROPE_TYPES)}"]
    if r.rope_type == "none":
        return []
    errs = []
    if r.factor < 1:
        errs.append(f"model.rope_scaling.factor={r.factor} must be >= 1")
    if not 0 < r.low_freq_factor < r.high_freq_factor:
        errs.append(f"model.rope_scaling.low_freq_factor={r.low_freq_factor} must be > 0 and "
                    f"< model.rope_scaling.high_freq_factor={r.high_freq_factor}")
    if r.original_max_position_embeddings < 1:
        errs.append(f"model.rope_scaling.original_max_position_embeddings="
                    f"{r.original_max_position_embeddings} must be >= 1")
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
