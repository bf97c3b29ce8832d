"""Typed configuration: one small dataclass per component.

Each component receives only its own slice (the model gets `ModelConfig`, the
pipeline gets `ParallelConfig`, ...). Hydra (see `framework/run/cli.py`) composes these
same dataclasses, so a misspelled key or a wrong type fails at composition time.

Nothing here imports JAX or any other part of the framework (but its errors): every
package reads its slice of these. The valid values of each setting with a fixed set of
them are `CHOICES`, the valid range of each number `RANGES`; `not_one_of` and
`check_ranges` return one line per problem, naming the setting and what is valid, and
`stage_layers_value` reads `parallel.stage_layers` (a list of counts or a word).
`ModelConfig` and the families' presets are in `config/model.py`, the ranges in
`config/ranges.py`; everyone imports them from `framework.config`.
Whether a whole configuration can be built on some devices (degrees, divisibility,
the schedule) is decided in `framework/engine/validate.py`; the schedules themselves
are a registry (`framework/parallel/pipeline/schedule.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from framework.errors import ConfigError
from framework.config.model import (FAMILIES, FAMILY_PRESETS,  # noqa: F401 (the
                                    PRESET_DEFAULTS, ModelConfig,  # package's names)
                                    MoeConfig, RopeScaling, cast_at_use)
from framework.config.ranges import (AT_LEAST_0, AT_LEAST_1, POSITIVE,  # noqa: F401
                                     RANGES, Range, check_ranges, setting_names)


# The valid values of every setting that has a fixed set of them.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16"),  # compute dtype; parameters: optim.param_dtype
    "model.attention": ("auto", "dense", "blockwise", "cudnn"),  # framework/model/attention.py
    "model.rope_scaling.rope_type": ("none", "llama3"),
    "model.family": tuple(FAMILIES),  # one record per family: framework/config/model.py
    "model.activation": ("silu", "gelu_tanh"),  # the gated MLP's, framework/model/layers.py
    "model.fp8": ("none", "tensorwise", "delayed"),  # framework/model/fp8.py, fp8_delayed.py
    # per layer (framework/model/stack.py's REMAT_POLICIES)
    "parallel.remat": ("none", "full", "save_dots", "save_dots_gathered"),
    "parallel.fsdp_regather": ("microbatch", "step"),  # framework/parallel/data.py
    "optim.schedule": ("cosine", "linear", "constant", "wsd"),  # framework/engine/optim.py
    "optim.decay_shape": ("linear", "cosine", "sqrt"),  # wsd's final decay
    "optim.mu_dtype": ("float32", "bfloat16"),  # AdamW's first moment
    "optim.param_dtype": ("float32", "bfloat16"),  # the stored (master) parameters
    "optim.name": ("adamw", "muon"),  # framework/engine/optim.py
    "train.resume": ("auto", "never"),  # framework/run/start.py
    "data.kind": ("synthetic", "markov", "text", "tokens", "corpus"),  # framework/io/data.py
    "data.verify": ("checksum", "size"),  # corpus shards against their manifest
    "data.token_dtype": ("uint16", "uint32"),
    "logging.wandb.mode": ("offline", "online", "disabled"),
    "devices.platform": ("auto", "cpu", "gpu", "tpu"),  # framework/runtime/devices.py
}


def not_one_of(key: str, value) -> str | None:
    """One line when `value` is not one of `CHOICES[key]`, else None."""
    valid = CHOICES[key]
    return None if value in valid else f"{key}={value!r} is not one of {', '.join(valid)}"


# Logical axes of the model that tensor parallelism may split (framework/model/llama.py
# declares them; framework/parallel/rules.py maps them onto the `tensor` mesh axis).
TENSOR_SPLITTABLE = ("heads", "kv_heads", "mlp", "vocab")


def shown(value) -> str:
    """A value as a user writes it on the command line: [2,'2'], true, null."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(shown, value)) + "]"
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value) if isinstance(value, str) else str(value)


_KINDS = {bool: "true/false", int: "a number", float: "a decimal number", str: "a string",
          list: "a list", tuple: "a list", dict: "a mapping"}
STAGE_LAYERS_FORMS = ("a list of positive whole numbers, the layers of each global stage "
                      "(e.g. [2,2]), or auto, or null (unset: model.n_layers split evenly)")


def stage_layers_value(given):
    """`parallel.stage_layers` as the pipeline reads it: None, "auto" or a tuple of layer
    counts (hashable). Anything else raises ConfigError: one line with what was given
    and the valid forms. Whether the counts fit the model and the pipeline is checked
    with the degrees (framework/engine/validate.py)."""
    if given is None or given == "auto":
        return given
    kind = lambda v: _KINDS.get(type(v), type(v).__name__)
    if not isinstance(given, (list, tuple)):
        problem = f"is {kind(given)}, not a list"
    elif wrong := [n for n in given if isinstance(n, bool) or not isinstance(n, int)]:
        problem = f"holds {shown(wrong[0])} ({kind(wrong[0])}) where a number of layers belongs"
    elif min(given, default=1) < 1:
        problem = f"holds {min(given)}, but every stage needs at least 1 layer"
    else:
        return tuple(given)
    raise ConfigError(f"parallel.stage_layers={shown(given)} {problem}: it takes "
                      f"{STAGE_LAYERS_FORMS}")


@dataclass(unsafe_hash=True)
class ParallelConfig:
    """How the model is laid out on the (pipe, data, context, tensor) mesh."""

    pipeline: int = 1
    data: int = 1  # -1: all devices left after pipeline x context x tensor
    tensor: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"  # gpipe | circular | 1f1b | interleaved_1f1b | zb_h1 | zb_v
    virtual_stages: int = 1  # layer chunks per pipeline rank (circular, interleaved_1f1b)
    remat: str = "none"  # none | full | save_dots | save_dots_gathered, per layer
    zero1: bool = False  # shard optimizer state + master params over `data`
    # FSDP (ZeRO-3): parameters, gradients and optimizer state sharded over `data`
    # through the step, each use gathering its weights (framework/parallel/data.py);
    # fsdp_regather: microbatch (every use gathers: least memory, m x the bytes) or
    # step (one gather per step, kept: ZeRO-1's program).
    fsdp: bool = False
    fsdp_regather: str = "microbatch"
    # Tick schedules (1f1b, interleaved_1f1b, zb_h1, zb_v): stage-to-stage sends run
    # beside the next tick's compute; more microbatches in flight (docs/parallelism.md,
    # "Sends that overlap compute"). null: the schedule's own (overlapped; zb_v
    # synchronous). GPipe/circular: synchronous.
    overlap_sends: Optional[bool] = None
    sequence_parallel: bool = False  # shard norms/residuals along seq over `tensor`
    # With sequence parallelism: each all-gather + matmul and matmul + reduce-scatter of
    # the layers as a ring of blocks, the sends beside the blocks' matmuls
    # (framework/parallel/tensor.py; docs/parallelism.md, "Collective matmul").
    collective_matmul: bool = False
    # The logical axes split over `tensor` (a subset of TENSOR_SPLITTABLE; the others
    # are replicated): the tensor-parallel plan, framework/parallel/rules.py.
    tensor_split: tuple[str, ...] = TENSOR_SPLITTABLE
    # Layers per pipeline stage (global stages: pipeline x chunks per rank, in the order
    # a microbatch visits them), e.g. [7, 9, 9, 7]; `auto` balances them with the
    # embedding's and the head's cost counted; null: model.n_layers split evenly.
    stage_layers: Any = None
    # Context parallelism: the sequence split over `context` devices, two mirrored
    # chunks each, attention as a ring (framework/parallel/context.py). Last, so that
    # ParallelConfig(pipeline, data, tensor, microbatches) keeps its meaning.
    context: int = 1
    # Expert parallelism: each MoE layer's experts sharded over `expert` devices carved
    # out of the `data` devices (parallel.data stays the number of data replicas of the
    # batch, of which `expert` consecutive ones form an expert group;
    # framework/parallel/expert.py). Must divide parallel.data; needs model.moe.
    expert: int = 1
    # The dropless exchange of token copies over `expert`: auto (ragged where the
    # compiler has ragged_all_to_all: TPU, NVIDIA GPU; dense elsewhere), dense
    # (worst-case buffers), ragged (exactly the copies; emulated where the compiler
    # lacks the op), emulated (the ragged bookkeeping over a dense exchange: tests).
    expert_exchange: str = "auto"
    # With a capacity factor: the slots exchanged and multiplied in this many parts, so
    # that one part's all-to-all can run beside another's matmuls (framework/model/moe.py).
    expert_chunks: int = 1
    # Tick schedules with a whole backward and overlapped sends (1f1b, interleaved_1f1b):
    # each BW and the F after it on the same rank run as one cell, the two layer loops
    # as one, so that one microbatch's collectives (the expert all-to-alls, tensor
    # parallelism's) run beside the other's matmuls (Megatron-LM's combined 1F1B;
    # docs/parallelism.md, "Combined 1F1B").
    combined_1f1b: bool = False

    def __post_init__(self):
        self.tensor_split = tuple(self.tensor_split)  # Hydra hands over a list
        self.stage_layers = stage_layers_value(self.stage_layers)

    @property
    def n_devices(self) -> int:
        return self.pipeline * self.data * self.context * self.tensor


@dataclass
class OptimConfig:
    """AdamW with linear warmup then `schedule` to `lr * min_lr_ratio`
    (framework/engine/optim.py)."""

    lr: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1  # decoupled (AdamW); never applied to norm scales
    decay_embeddings: bool = True  # also decay the embedding table (nanoGPT, Megatron-LM do)
    # Parameter paths AdamW never decays, as shell patterns over names like
    # layers/attn/wqkv, embed/table, head/w (besides the norm scales).
    no_decay: tuple[str, ...] = ()
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"  # after warmup: cosine | linear | constant | wsd
    # wsd (warmup-stable-decay): the final decay's length in steps (null: the last 20%
    # of train.steps) and shape; a cooldown branched off a checkpoint at step S is a run
    # resumed there with train.steps = S + decay_steps.
    decay_steps: Optional[int] = None
    decay_shape: str = "linear"
    z_loss: float = 0.0  # + z_loss * (log Z)^2 per token (PaLM), the training loss only
    mu_dtype: str = "float32"  # the first moment (AdamW's second stays float32)
    # The parameters as stored and updated (master weights) and their gradients:
    # bfloat16 halves both; the optimizer still computes in float32 (engine/optim.py)
    param_dtype: str = "float32"
    # adamw, or muon: Muon on the layers' matrices, AdamW (the settings above) on the
    # embedding, head and norms; Muon's momentum
    name: str = "adamw"
    muon_momentum: float = 0.95

    def __post_init__(self):
        # Hydra hands over a list; one pattern may come as a string
        self.no_decay = (self.no_decay,) if isinstance(self.no_decay, str) else tuple(
            self.no_decay)


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
    # A Hugging Face folder of a Llama, Qwen2, Qwen3 or Mistral (config.json +
    # safetensors): start at step 0 from its weights; the model settings are read from
    # its config.json (framework/io/hf/family.py).
    init_from: Optional[str] = None
    # Resume from a checkpoint whose optimizer state is another optimizer's (optim.name
    # changed): keep its weights and step, start the optimizer afresh (run/start.py).
    reset_optimizer: bool = False


@dataclass
class DataConfig:
    """Token source. kind: synthetic | markov | text | tokens | corpus (see
    framework/io/data.py)."""

    kind: str = "synthetic"
    # text: a UTF-8 file; tokens: a flat uint16/uint32 file; corpus: a folder of shards
    path: Optional[str] = None
    token_dtype: str = "uint16"  # tokens: dtype of the binary file
    holdout_fraction: float = 0.05  # share of the data kept out of training for eval/loss
    markov_concentration: float = 0.1  # markov: Dirichlet concentration of each row
    verify: str = "checksum"  # corpus: each shard's SHA-256 (or only its size) at start
    prefetch: int = 2  # batches made ahead by a background thread (0: when needed)
    # corpus: several corpora in proportion, [{path: <folder>, weight: <share>}, ...]
    # (framework/io/corpus_dataset.py); Any, as eval.sets, for Hydra's list of dicts.
    mixture: Any = None
    # Attention within each packed document only (documents end in the corpus's eos_id,
    # framework/model/documents.py), and RoPE positions restarting at each of them.
    document_mask: bool = False
    reset_positions: bool = False


@dataclass
class EvalConfig:
    every: int = 0  # steps between eval/loss measurements (0: never)
    batches: int = 2  # held-out batches averaged per evaluation
    sample_prompt: Optional[str] = None  # at each evaluation, continue this text (greedy)
    # Named validation sets {name: corpus folder} (data.kind=corpus's format), each
    # logged as eval/<name>/loss at every evaluation (framework/io/data.py, eval_sets).
    # Any: Hydra merges a dict given on the command line into a typed one (and then
    # refuses its new keys); into None it sets it.
    sets: Any = None
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
    tensorboard: bool = False  # also write TensorBoard scalars to <run>/tensorboard


@dataclass
class DevicesConfig:
    platform: str = "auto"  # auto | cpu | gpu | tpu
    local_device_count: Optional[int] = None  # simulated CPU devices per process
    # Refuse, before allocating anything, a run predicted not to fit the devices' memory
    # (framework/analysis/memory_check.py); memory_limit_gb replaces the detected limit (GiB/device).
    memory_check: bool = True
    memory_limit_gb: Optional[float] = None


@dataclass
class ProfileConfig:
    """Steps traced with jax.profiler to time the pipeline bubble (framework/analysis/profiling.py)."""

    steps: int = 2  # steps traced (0: no profile)
    start_step: int = 3  # the first traced step (moved earlier, not before a run's 2nd, if needed)
    keep_trace_mb: float = 50.0  # keep the raw trace in <run>/profile if at most this size


@dataclass
class DistributedConfig:
    """Multi-host (framework/runtime/distributed.py): unset for one process, or for one task of
    a multi-task SLURM step (detected); all three for an explicit launch; or
    num_processes=-1 to let jax.distributed.initialize() detect the cluster."""

    coordinator_address: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None  # -1: detect (SLURM, Cloud TPU, Open MPI); 1: never
    process_id: Optional[int] = None
    # Seconds without a heartbeat after which JAX's coordination service declares a
    # process dead and ends the others (framework/runtime/peers.py; JAX's default).
    heartbeat_timeout_s: int = 100


@dataclass
class GenerateConfig:
    """`python -m framework.generate key=value ...` (framework/run/generate.py)."""

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


@dataclass
class CompileConfig(RunConfig):
    """`python -m framework.compile`: a run's configuration and the cluster it is
    compiled for (framework/compile/targets.py): local, tpu:v5p-256, gpu:h100x64, ..."""

    target: str = "local"
