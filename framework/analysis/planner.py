"""Which (pipeline, data, context, tensor, microbatches, schedule, sharding) layout to pick, before
spending cluster hours: every valid layout for a device count, its per-device memory
(`framework/analysis/memory_model.py`) and step time (below), ranked. Nothing here needs a
device or compiles anything: `tools/plan.py` is the command line.

Step time (seconds), no overlap of computation and communication assumed, except for
the pipeline's stage-to-stage sends when they overlap (`parallel.overlap_sends`) and the
layers' tensor-parallel bytes under a collective matmul (`parallel.collective_matmul`):
those are hidden behind the compute, up to its length (not the rings a recompute runs
without their matmuls, `Remat.rings_alone`; none where a split backward records its
weight ops' inputs and runs no collective matmul: `Layout.records_weight_ops`).

  compute    model FLOPs (PaLM 6N + attention, `framework/analysis/flops.py`) plus the forward
             that remat recomputes, at the given peak FLOP/s, split over data x tensor:
             every tick lasts as long as the slowest global stage's layers, v of them per
             rank, stretched by the schedule table's bubble (lockstep ticks with
             unit-cost cells, `Schedule.bubble_fraction`; GPipe: (p-1)/(m+p-1), Huang et
             al. 2019), t = v * max stage flops / (data * context * tensor * peak) /
             (1 - bubble) (context parallelism: each device 1/context of the tokens);
             plus the LM head on the last stage, less the slack its fewer layers leave
             (uneven stages, `parallel.stage_layers`; even stages: all of it). Even
             stages: t = layer flops / (N * peak) / (1 - bubble) + head / (dp * tp * peak).
  accumulate the gradient accumulation's memory traffic (framework/analysis/accumulation.py:
             each microbatch's weight gradients added into the stored-dtype sums) at
             the device's HBM bandwidth (`hardware.memory_bandwidth`; none unknown)
  comm       bytes per device per step on each mesh axis (`framework/analysis/comm_model.py`)
             over that axis's bandwidth; `tensor` is innermost on the mesh, so an axis
             uses the in-node link (NVLink) while the devices it spans fit in one node.
             The ring attention's shifts (`context`) are counted exposed: that the
             compiler runs them beside the ring's blocks is read from the program
             (`framework.compile`'s `comm/overlapped_fraction/context`), not assumed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np

from framework import hardware
from framework.units import memory_unit
from framework.analysis import calibration, comm_model
from framework.analysis.accumulation import accumulated_bytes
from framework.config import ModelConfig, ParallelConfig, TrainConfig
from framework.engine.resolved import resolved, with_exchange
from framework.engine.validate import check, combined_where_possible
from framework.analysis.memory_model import predict_memory
from framework.parallel.mesh import PIPE, TENSOR, degrees
from framework.model.prefix import RECOMPUTED, prefix_layers, stack_layers
from framework.model.attention import kernel_for
from framework.model.moe import executed_rows
from framework.model.flops import (fp8_matmul_share, hardware_flops_per_token,
                                   layer_shares, model_flops_per_token)
from framework.parallel.pipeline.schedule import (chunks_per_rank, schedule_names,
                                                  uses_virtual_stages)

_ASSUMED = hardware.accelerator(hardware.DEFAULT)


@dataclass(frozen=True)
class Hardware:
    """What the planner assumes about the cluster. Bandwidths are per device and per
    direction (bytes/s); an axis whose devices fit in one node uses `intra_node`, else
    `inter_node`, unless `axis_bandwidth` pins it (the user's tensor/pipe/data_gbps)."""

    memory_bytes: float
    peak_flops: float  # per device, for the model's compute dtype
    fp8_peak_flops: float | None = None  # per device, FP8 matmuls (None: not known)
    intra_node: float = _ASSUMED.link_bytes  # NVLink 4 (H100 SXM): 900 GB/s both ways
    inter_node: float = _ASSUMED.network_bytes  # one 400 Gb/s InfiniBand NDR link per GPU
    devices_per_node: int = _ASSUMED.per_node
    axis_bandwidth: tuple = ()  # ((axis, bytes/s), ...) overrides
    memory_fraction: float = hardware.USABLE_FRACTION  # of memory_bytes XLA may fill
    platform: str | None = None  # whose compiler the memory model predicts for (None:
    #                              this process's backend; transients.logit_copies)
    device: str | None = None  # the device kind whose measured rates the compute time
    #                            takes (framework/analysis/calibration.py); None: peak
    memory_bandwidth: float | None = None  # HBM bytes/s (None: `device`'s, if known)

    @property
    def hbm(self) -> float | None:
        """HBM bytes/s per device: as given, else the catalogue's for `device`."""
        return self.memory_bandwidth or (self.device and hardware.memory_bandwidth(self.device))

    def bandwidth(self, axis: str, parallel: ParallelConfig) -> float:
        pinned = dict(self.axis_bandwidth)
        if axis in pinned:
            return pinned[axis]
        # An axis's groups span the devices of the axes inside it (the mesh's order,
        # tensor innermost: framework/parallel/mesh.py) times its own degree.
        sizes = list(degrees(parallel).values())
        span = math.prod(sizes[list(degrees(parallel)).index(axis):])
        return self.intra_node if span <= self.devices_per_node else self.inter_node


_COMM: dict = {}  # comm_model.expected_bytes, once per layout


def _comm_bytes(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                param_dtype: str = "float32") -> dict:
    # every setting the bytes depend on: ZeRO-1 and FSDP, the microbatches and the
    # schedule (the stage sends) among them (the model's shapes are traced once)
    key = (model, parallel, train.global_batch_size, train.seq_len, param_dtype)
    if key not in _COMM:
        _COMM[key] = comm_model.expected_bytes(model, parallel, train, param_dtype=param_dtype)
    return _COMM[key]


def ring_hidden_share(model: ModelConfig, tp: int, bytes_per_flop: float) -> float:
    """The share of a layer's collective-matmul transfers its matmuls can hide
    (framework/parallel/tensor.py): a ring step sends rows x d_model while multiplying
    them by this device's k columns (q/k/v, gate/up) or rows (output, down) of a weight:
    matmul / transfer = 2 k / (bytes per element) x (link bytes/s) / (peak FLOP/s), a
    shorter matmul hiding that ratio; the mean over the four weight ops (equal bytes).
    H100 (450 GB/s NVLink, 989 TFLOP/s): k >= 2,198 hides all."""
    itemsize = np.dtype(model.dtype).itemsize
    qkv = (model.n_heads + 2 * model.n_kv_heads) * model.head_dim
    ks = (qkv / tp, model.n_heads * model.head_dim / tp, 2 * model.d_ff / tp,
          model.d_ff / tp)
    return sum(min(1.0, 2 * k / itemsize * bytes_per_flop) for k in ks) / len(ks)


def predict_time(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                 hw: Hardware, optim=None) -> dict:
    """Predicted seconds per step by term (see the module docstring), with the bubble
    and the MFU (model FLOPs, no remat, over N * peak * step time) they imply; `optim`:
    the stored parameters' dtype, which the gradients travel in (default float32)."""
    dp, tp, cp, n = parallel.data, parallel.tensor, parallel.context, parallel.n_devices
    lay = resolved(model, parallel, train.seq_len, train.global_batch_size)
    sched = lay.program.schedule
    tokens = train.global_batch_size * train.seq_len
    rows = executed_rows(model, train.seq_len, hardware.expands_ragged_dot(hw.platform))
    layers, head = _hardware_flops(model, lay, train.seq_len, hw, rows)
    # ticks last as long as the slowest stage's layers, plus the head beyond its slack
    layers *= fp8_slowdown(model, train.seq_len, hw)
    unit_share, dense_share = layer_shares(model, train.seq_len, rows)  # (prefix.py's units)
    cost = [n * layers * unit_share for n in lay.stage_layer_counts]
    # a dense prefix (prefix.py): always recomputed in the first stage's backward
    cost[0] += prefix_layers(model) * layers * dense_share * (
        1.0 if lay.remat.recompute_forward else RECOMPUTED)
    head_beyond = max(0.0, cost[-1] + head - max(cost))
    share = calibration.layout_rate(lay, train.seq_len, hw.device, hw.platform) or 1.0
    # context: 1/cp of each sequence; at the measured share of the peak where known
    per_flop = tokens / (dp * cp * tp) / (hw.peak_flops * share)
    out = {"compute": sched.n_chunks * max(cost) * per_flop / (1 - sched.bubble_fraction)
           + head_beyond * per_flop}
    stored = optim.param_dtype if optim is not None else "float32"
    out["accumulate"] = accumulated_bytes(lay, stored, hw.platform) / hw.hbm if hw.hbm else 0.0
    exchanged = with_exchange(parallel, hw.platform or "gpu")  # the expert exchange hw's runs
    for axis, nbytes in _comm_bytes(model, exchanged, train, stored).items():
        out[f"comm_{axis}"] = nbytes / hw.bandwidth(axis, parallel)
    budget = out["compute"]  # what overlapped transfers can hide behind, at most
    if sched.overlap:  # the stage-to-stage sends run beside the cells, hidden up to them
        sends = comm_model.stage_sends(model, parallel, train) / hw.bandwidth(PIPE, parallel)
        out["comm_pipe"] -= min(sends, budget)
        budget -= min(sends, budget)
    if parallel.collective_matmul and lay.sequence_parallel and not lay.records_weight_ops:
        # the rings hide where a block's matmul outlasts its transfer, up to the compute
        # left; not those a recompute runs alone (`Remat.rings_alone`)
        bw = hw.bandwidth(TENSOR, parallel)
        alone = comm_model.recomputed_ring_share(model, parallel, lay.split_recomputes) \
            if lay.remat.rings_alone else 0.0
        rings = comm_model.layer_tensor_bytes(model, parallel, train) / bw
        hides = ring_hidden_share(model, tp, bw / hw.peak_flops) * (1 - alone)
        out["comm_tensor"] -= min(rings * hides, budget)
        budget -= min(rings * hides, budget)  # (what combined cells may hide next)
    if lay.program.combined:
        _combined_hidden(out, lay, budget)
    out["total"] = sum(out.values())
    out["bubble"] = sched.bubble_fraction
    out["rate"] = share  # of the peak the compute term assumes (1: no measurement)
    # the cells of the head's rank, one step, without waits (what tools/mock_gpu.py times)
    head_rank = lay.program.stages.rank[-1]
    out["stage"] = (sum(cost[g] for g in lay.program.stages.of[head_rank]) + head) * per_flop \
        + out["accumulate"]
    ideal = model_flops_per_token(model, train.seq_len) * tokens / n / format_peak(model, hw)
    out["mfu"] = ideal / out["total"]
    return out


def _hardware_flops(model: ModelConfig, lay, seq_len: int, hw: Hardware, rows: float):
    """(the layers', the head's) hardware FLOPs per token. Of the attention a fused
    backward recomputes only the dense kernel's scores (the others' output and
    log-sum-exp are kept, `blockwise.ATTENDED`); a split backward's passes run it again."""
    sched = lay.program.schedule
    again = kernel_for(model, seq_len, hw.platform or "gpu") == "dense" or sched.split_backward
    return hardware_flops_per_token(model, seq_len, lay.remat.recompute_forward,
                                    lay.remat.recompute_attention and again,
                                    sched.split_backward, rows)


def _combined_hidden(out: dict, lay, budget: float) -> None:
    """`parallel.combined_1f1b`: the combined cells' expert exchange (`Program.fused_share`)
    runs beside the other microbatch's matmuls, hidden up to the compute left (the GPU
    compiler put a matmul beside every all-to-all of Mixtral's: docs/parallelism.md);
    the warm-up and cool-down cells' stays exposed, and tensor bytes as without."""
    hidden = min(out.get("comm_expert", 0.0) * lay.program.fused_share, budget)
    if hidden > 0:
        out["comm_expert"] -= hidden


def format_peak(model: ModelConfig, hw: Hardware) -> float:
    """The peak the MFU is measured against: the layers' matmuls' number format's
    (framework/analysis/flops.py `matmul_format`), FP8's where known."""
    return hw.fp8_peak_flops if model.fp8 != "none" and hw.fp8_peak_flops else hw.peak_flops


def fp8_slowdown(model: ModelConfig, seq_len: int, hw: Hardware) -> float:
    """The layers' compute time with `model.fp8` over the same FLOPs at the compute
    dtype's peak. Where the device measured FP8 against bfloat16, that ratio
    (`calibration.fp8_slowdown`: 0.92 on an H200, the quantization's passes included);
    else the FP8 matmuls' share (`fp8_matmul_share`) at the FP8 peak and the rest
    (attention's dots) at the compute dtype's, assuming what remat recomputes has the
    same share and the FP8 GEMMs reach the same fraction of their peak as BF16's (a
    floor: it would promise the 8B stage 0.6x, which ran 0.96x). 1 without FP8."""
    share = fp8_matmul_share(model, seq_len)
    if not share or not hw.fp8_peak_flops:
        return 1.0
    measured = calibration.fp8_slowdown(hw.device)
    if measured is not None:
        return measured
    return share * hw.peak_flops / hw.fp8_peak_flops + (1 - share)


@dataclass
class Plan:
    parallel: ParallelConfig
    memory: dict  # bytes per device, by term (memory_model.predict_memory)
    time: dict  # seconds per step, by term (predict_time)
    fits: bool
    tokens_per_step: int

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens_per_step / self.time["total"]


def _powers_of_two(lo: int, hi: int) -> list[int]:
    return [2**k for k in range(max(hi, 1).bit_length()) if lo <= 2**k <= hi]


def _stage_layers(model: ModelConfig, base: ParallelConfig, n_stages: int):
    """`base`'s stage_layers where they fit n_stages global stages; else even where the
    layers divide, `auto` where they do not."""
    given = base.stage_layers
    if isinstance(given, tuple) and len(given) == n_stages:
        return given
    if given is None and stack_layers(model) % n_stages == 0:
        return None
    return "auto"


def _virtual_stages(model: ModelConfig, p: int, given) -> tuple[int, ...]:
    """Chunks per rank to try: `given`, or (None) every v from 2 to 8 that splits each
    rank's layers evenly (Megatron-LM's 70B layout on 64 H100s: 5 of 10), else 2 and 4
    (uneven stages)."""
    if given is not None:
        return tuple(given)
    n = stack_layers(model)
    per_rank = n // p if n % p == 0 else 0
    return tuple(v for v in range(2, 9) if per_rank and per_rank % v == 0) or (2, 4)


# What `data` shards beyond the batch: nothing, ZeRO-1, FSDP (zero1, fsdp)
_SHARDINGS = ((False, False), (True, False), (False, True))


def sharding_name(par: ParallelConfig) -> str:
    return "fsdp" if par.fsdp else "zero1" if par.zero1 else "no"


def enumerate_layouts(model: ModelConfig, train: TrainConfig, n_devices: int,
                      base: ParallelConfig, schedules=None,
                      virtual_stages=None) -> list[ParallelConfig]:
    """Every valid (pipeline, data, context, tensor, microbatches, schedule, zero1 or fsdp,
    and for a mixture of experts the expert degree: `_experts`)
    on n_devices (`framework.engine.validate.check` decides validity); remat and sequence
    parallelism come from `base`, and `parallel.combined_1f1b` on the layouts whose table
    can run combined; context degrees that leave each device at least
    MIN_CONTEXT_TOKENS of a sequence (`_contexts`); schedules: every registered one by
    default, those with virtual stages at each of `virtual_stages` (default:
    `_virtual_stages`); uneven stages (`auto`) where the layers do not divide the
    pipeline's stages. Without a pipeline: gradient accumulation over powers of two
    microbatches from 1 (GPipe's table of one stage: `autodiff.accumulated`). With one:
    powers of two from p (fewer leave most of the pipeline idle) up to one row per
    microbatch."""
    schedules = schedule_names() if schedules is None else schedules
    out = []
    for p, tp, cp in _degrees(n_devices, _contexts(train.seq_len)):
        dp = n_devices // (p * tp * cp)
        micro = _powers_of_two(p, train.global_batch_size // dp)
        options = [("gpipe", m, 1) for m in micro] if p == 1 else [
            (s, m, v) for s in schedules for m in micro
            for v in (_virtual_stages(model, p, virtual_stages)
                      if uses_virtual_stages(s) else (1,))]
        for schedule, m, v in options:
            stage_layers = _stage_layers(model, base, p * chunks_per_rank(schedule, v))
            for (zero1, fsdp), e in itertools.product(
                    _SHARDINGS if dp > 1 else _SHARDINGS[:1], _experts(model, dp)):
                par = dataclasses.replace(base, pipeline=p, data=dp, tensor=tp, context=cp,
                                          microbatches=m, schedule=schedule,
                                          virtual_stages=v, zero1=zero1, fsdp=fsdp,
                                          stage_layers=stage_layers, expert=e)
                par = combined_where_possible(par)
                if not check(model, par, train, n_devices):
                    out.append(par)
    return out


def _experts(model: ModelConfig, dp: int) -> list[int]:
    """Expert-parallel degrees to try (`parallel.expert`): for a mixture of experts, the
    powers of two dividing both the data replicas and the experts; 1 otherwise."""
    if not model.moe.enabled:
        return [1]
    return [e for e in _powers_of_two(1, dp) if dp % e == 0 and model.moe.experts % e == 0]


# Context parallelism only where each device keeps at least this many tokens of a
# sequence: below, a ring step's attention is too short to hide the next shift, and
# sequence parallelism already splits the activations as finely.
MIN_CONTEXT_TOKENS = 4096


def _contexts(seq_len: int) -> list[int]:
    return [1] + [c for c in _powers_of_two(2, seq_len // MIN_CONTEXT_TOKENS)
                  if seq_len % (2 * c) == 0]


def _degrees(n_devices: int, contexts: list[int]):
    """(pipeline, tensor, context) whose product divides n_devices."""
    for p in range(1, n_devices + 1):
        for tp in range(1, n_devices // p + 1):
            for cp in contexts:
                if n_devices % (p * tp * cp) == 0:
                    yield p, tp, cp


def evaluate(model: ModelConfig, train: TrainConfig, par: ParallelConfig, hw: Hardware,
             optim=None) -> Plan:
    """One layout's predictions; `optim` the stored dtypes (optim.param_dtype, mu_dtype)."""
    mem = predict_memory(model, par, train, hw.platform, optim)
    return Plan(par, mem, predict_time(model, par, train, hw, optim),
                mem["total"] <= hw.memory_bytes * hw.memory_fraction,
                train.global_batch_size * train.seq_len)


def plan(model: ModelConfig, train: TrainConfig, base: ParallelConfig, n_devices: int,
         hw: Hardware, optim=None, **enumerate_kw) -> list[Plan]:
    """Every valid layout with its predictions: fitting ones first, fastest first, then
    the fewer microbatches (at p 1 accumulating takes the time of one microbatch, and
    each further one reads and writes the gradient sums and casts the weights again:
    +1.0 GiB a row of kernel traffic for llama_1b_1gpu's 28 rows in 2, the GPU
    compiler's count, docs/performance.md), then the smallest memory."""
    plans = [evaluate(model, train, par, hw, optim)
             for par in enumerate_layouts(model, train, n_devices, base, **enumerate_kw)]
    return sorted(plans, key=lambda pl: (not pl.fits, pl.time["total"],
                                         pl.parallel.microbatches, pl.memory["total"]))


def table(plans: list[Plan], top: int = 20, unfit: int = 5) -> str:
    """The `top` fitting layouts, then the `unfit` best that do not fit (marked NO), as
    a fixed-width table: memory per device in GiB (MiB for small models), times in ms
    per step."""
    shown = [pl for pl in plans if pl.fits][:top] + [pl for pl in plans if not pl.fits][:unfit]
    unit, name = memory_unit(max((pl.memory["total"] for pl in shown), default=0))
    head = (f"{'#':>3} {'pp':>3} {'dp':>3} {'ep':>3} {'cp':>3} {'tp':>3} {'mb':>4} "
            f"{'schedule':<19} "
            f"{'shard':<5} {'mem ' + name:>8} {'state':>7} {'grads':>7} {'acts':>7} "
            f"{'fits':<4} {'step ms':>9} {'compute':>9} {'accum':>6} {'tensor':>8} "
            f"{'pipe':>8} "
            f"{'data':>8} {'context':>8} {'expert':>8} {'bubble':>6} {'tokens/s':>11} "
            f"{'MFU':>6}")
    lines = [head, "-" * len(head)]
    for i, pl in enumerate(shown, 1):
        par, m, t = pl.parallel, pl.memory, pl.time
        gib = lambda *keys: sum(m[k] for k in keys) / unit
        sched = par.schedule + (f"/v{par.virtual_stages}" if uses_virtual_stages(par.schedule) else "")
        lines.append(
            f"{i:>3} {par.pipeline:>3} {par.data:>3} {par.expert:>3} {par.context:>3} "
            f"{par.tensor:>3} "
            f"{par.microbatches:>4} {sched:<19} {sharding_name(par):<5} {gib('total'):>8.2f} "
            f"{gib('params', 'optimizer', 'tokens'):>7.2f} {gib('gradients'):>7.2f} "
            f"{gib('activations', 'transient'):>7.2f} {'yes' if pl.fits else 'NO':<4} "
            f"{t['total'] * 1e3:>9.4g} {t['compute'] * 1e3:>9.4g} {t['accumulate'] * 1e3:>6.3g} "
            f"{t['comm_tensor'] * 1e3:>8.3g} {t['comm_pipe'] * 1e3:>8.3g} "
            f"{t['comm_data'] * 1e3:>8.3g} {t['comm_context'] * 1e3:>8.3g} "
            f"{t.get('comm_expert', 0.0) * 1e3:>8.3g} "
            f"{t['bubble']:>6.1%} {pl.tokens_per_sec:>11,.0f} "
            f"{t['mfu']:>6.1%}")
    return "\n".join(lines)
