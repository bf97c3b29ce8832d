"""The layout of one configuration, resolved once: every fact derived from the settings
that more than one reader needs, with this module as its one owner.

    layout = resolved(model, parallel, seq_len, global_batch)    # after validation
    layout.degrees           {pipe, data, context, tensor} in mesh order
    layout.sequence_parallel in effect (the setting, and more than one tensor device)
    layout.manual            the axes the loss is summed and parameters made per-device over
    layout.remat             the setting's `Remat` (what the backward recomputes, its cost)
    layout.layer_remat       the policy the layers run under (FSDP per use: save_dots)
    layout.chunks_per_rank, .global_stages, .stage_layers, .stage_layer_counts,
    layout.chunk_layers, .v_shape
    layout.program           the schedule compiled once (framework/parallel/pipeline/program.py)
    layout.rows_per_replica, .rows_per_microbatch, .seq_per_device, .hidden_seq

The engine, the parameter layout, checkpoint conversion, the memory, communication and
FLOP models, the planner, the executor-state measurement and the tools read these here
instead of re-deriving them from the raw settings (torchtitan's `ParallelDims` plays
this part there). `framework/engine/validate.py` decides whether a configuration can be
built at all; a `Layout` is made only of configurations it accepted (`resolve`), or by
the analyses for layouts they enumerate (`resolved`, cached).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property, lru_cache

from jax.sharding import AbstractMesh

from framework import hardware
from framework.config import ModelConfig, ParallelConfig
from framework.model.flops import stage_flops_per_token
from framework.model.stack import REGATHERING
from framework.model.prefix import stack_layers
from framework.parallel.data import gathers_per_use
from framework.parallel.mesh import (CONTEXT, DATA, EXPERT, PIPE, TENSOR, batch_axes, degrees,
                                     expert_degree, mesh_axes)
from framework.parallel.pipeline.layout import balance
from framework.parallel.pipeline.program import Program, program
from framework.parallel.pipeline.schedule import chunks_per_rank, overlaps_by_default
from framework.parallel.pipeline.table import V_SHAPE


@dataclass(frozen=True)
class Remat:
    """What `parallel.remat` makes a layer's backward do (framework/model/llama.py runs
    the policy). `backward_in_f`: a fused backward's cost in forwards, rounded to the
    whole cells a BW is cut into with synchronous sends (`Layout.backward_parts`): 2
    (input and weight gradients: each a forward's matmuls, Narayanan et al. 2021), 3
    under full remat (the forward first). save_dots also recomputes the dense kernel's
    attention scores and weighted values (batched dots, not saved), a small share of a
    forward: rounded away in the cell count, charged by the planner
    (`framework/model/flops.py`); the fused, blockwise and ring kernels' output is kept.
    save_dots_gathered keeps f's gathered sequence too (sequence parallelism): its
    recompute gathers nothing again."""

    name: str
    recompute_forward: bool  # the whole layer forward again before its backward
    # the attention's batched dots again (save_dots): in a fused backward only the dense
    # kernel's; the others' output and log-sum-exp are kept (`blockwise.ATTENDED`)
    recompute_attention: bool
    backward_in_f: int
    keeps_gathered: bool = False  # f's gathered sequence (`tensor.GATHERED`)
    # the remat whose measured stages give this one's compute rate (`rated_as`), if not
    # its own: save_dots_gathered runs save_dots's matmuls and kernels (what it saves is
    # communication, which the planner counts)
    measured_as: str = ""

    @property
    def regathers(self) -> bool:
        """The backward's recompute gathers the sequence-parallel inputs of the weight
        gradients' matmuls again (f: a gathering ring under collective matmuls)."""
        return self.keeps_inputs_only and not self.keeps_gathered

    @property
    def rings_alone(self) -> bool:
        """A collective matmul's rings that the layer's recompute runs again have no
        matmul beside them: the policy keeps the matmuls' outputs, not their gathered
        inputs, and its backward does not gather them again itself beside the weight
        gradients' matmuls (`stack.REGATHERING`: save_dots since 2026-12-03; the GPU
        compiler overlapped 89% of llama3_8b's tensor bytes before, 99% after). A
        zero-bubble split backward under remat runs the same layers (its B and W pull
        dy through the VJP F stashed: `SplitBackward.recompute`), so the same holds
        there (ZB-V and ZB-H1 under save_dots: 92% -> 99%). No policy has such rings
        now; one outside `REGATHERING` that keeps the matmuls' outputs would."""
        return self.regathers and not self.recompute_forward and self.name not in REGATHERING

    @property
    def rated_as(self) -> str:
        """The remat under which framework/analysis/calibration.py looks up its rate."""
        return self.measured_as or self.name

    @property
    def keeps_inputs_only(self) -> bool:
        """The stash holds each layer's input only: a split backward's B and W recompute
        from it (`SplitBackward.recompute`)."""
        return self.name != "none"


REMATS = {"none": Remat("none", False, False, 2),
          "save_dots": Remat("save_dots", False, True, 2),
          "save_dots_gathered": Remat("save_dots_gathered", False, True, 2, keeps_gathered=True,
                                      measured_as="save_dots"),
          "full": Remat("full", True, False, 3)}


def global_stages(parallel: ParallelConfig) -> int:
    """Pipeline ranks x the layer chunks each holds (the schedule's, or virtual_stages)."""
    return parallel.pipeline * chunks_per_rank(parallel.schedule, parallel.virtual_stages)


def overlapped(parallel: ParallelConfig) -> bool:
    """`parallel.overlap_sends`, or where it is null the schedule's own default."""
    if parallel.overlap_sends is None:
        return overlaps_by_default(parallel.schedule)
    return bool(parallel.overlap_sends)


@dataclass(frozen=True, eq=False)
class Layout:
    """A validated (model, parallel) and, for the per-device token counts, the step's
    shape. `parallel.stage_layers` is resolved: counts per global stage, or None (even)."""

    model: ModelConfig
    parallel: ParallelConfig
    seq_len: int | None = None
    global_batch: int | None = None

    # --- The mesh ----------------------------------------------------------------------
    @property
    def degrees(self) -> dict[str, int]:
        return degrees(self.parallel)

    @property
    def abstract_mesh(self) -> AbstractMesh:
        """The mesh's axes and degrees without devices (for tracing per-device shapes)."""
        return AbstractMesh(tuple(self.degrees.values()), mesh_axes(self.parallel))

    @property
    def expert(self) -> int:
        """The expert-parallel degree (`parallel.expert`; 1 without)."""
        return expert_degree(self.parallel)

    @property
    def batch_axes(self):
        """The mesh axes the batch's rows are split over: `data` (and `expert`)."""
        return batch_axes(self.parallel)

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism in effect: with one tensor device it is a no-op (it
        crashed: the norms' gradients were typed as varying over `tensor`)."""
        return self.parallel.sequence_parallel and self.parallel.tensor > 1

    @property
    def manual(self) -> tuple[str, ...]:
        """The mesh axes replicated parameters are made per-device over, and the loss
        summed over: `context` only where it splits the sequence."""
        return (PIPE, DATA) + ((EXPERT,) if self.expert > 1 else ()) + \
            ((CONTEXT,) if self.parallel.context > 1 else ())

    @property
    def vary_over(self) -> tuple[str, ...]:
        """The axes the weights are typed as varying over inside the step (expert
        leaves, sharded over `expert`, vary over it already)."""
        return self.manual + ((TENSOR,) if self.sequence_parallel else ())

    @property
    def microbatch_axes(self) -> tuple[str, ...]:
        """The axes one microbatch of a data replica is split over (its sequence over
        `context`, its features or sequence over `tensor`): a whole-tensor statistic of
        a microbatch (FP8's scales) reduces over these, so that a layout computes what
        one device computes with data x microbatches microbatches."""
        return tuple(a for a in (CONTEXT, TENSOR) if self.degrees[a] > 1)

    @property
    def microbatch_groups(self) -> int:
        """Microbatches of one data replica in a step, over all replicas: the groups a
        per-microbatch statistic (MoE's auxiliary losses) is averaged over, and the
        microbatch count one device needs to compute what this layout computes."""
        return self.parallel.data * self.parallel.microbatches

    @property
    def gathers_per_use(self) -> bool:
        """FSDP gathering each use's weights (framework/parallel/data.py)."""
        return gathers_per_use(self.parallel)

    # --- Remat -------------------------------------------------------------------------
    @property
    def remat(self) -> Remat:
        return REMATS[self.parallel.remat]

    @property
    def layer_remat(self) -> str:
        """The policy the layers run under: FSDP gathering per use runs no remat as
        save_dots (gathered weights are never saved for the backward, which gathers them
        again; a pipeline would keep them once per microbatch in flight)."""
        return "save_dots" if self.gathers_per_use and self.remat.name == "none" \
            else self.remat.name

    @property
    def recomputes(self) -> bool:
        """Whether the layers' backward recomputes any of their forward."""
        return self.layer_remat != "none"

    @property
    def split_recomputes(self) -> bool:
        """A zero-bubble split backward whose B and W each pull the incoming gradient
        through the layers' whole VJP from their inputs (any remat:
        `SplitBackward.recompute`): W runs the backward's collectives again."""
        return self.program.schedule.split_backward and self.remat.keeps_inputs_only

    @property
    def records_weight_ops(self) -> bool:
        """A split backward keeping the weight ops' inputs (no remat): its forward and B
        record them (framework/model/weight_ops.py), so no collective matmul runs: the
        tensor-parallel rings are plain gathers and scatters (the GPU compiler
        overlapped 0% of llama3_8b's tensor bytes under ZB-V, 2026-12-02)."""
        return self.program.schedule.split_backward and not self.remat.keeps_inputs_only

    # --- The pipeline's stages ----------------------------------------------------------
    @property
    def chunks_per_rank(self) -> int:
        return chunks_per_rank(self.parallel.schedule, self.parallel.virtual_stages)

    @property
    def global_stages(self) -> int:
        return global_stages(self.parallel)

    @property
    def v_shape(self) -> bool:
        """The schedule places its stages in a V (ZB-V): so does the parameter layout."""
        return self.program.stages.placement == V_SHAPE

    @property
    def stage_layers(self) -> tuple | None:
        """Real layers per global stage (uneven stages), None when even."""
        return self.parallel.stage_layers

    @property
    def stage_layer_counts(self) -> tuple[int, ...]:
        """Real layers of every global stage, even or not."""
        return self.stage_layers or (stack_layers(self.model) // self.global_stages,) * \
            self.global_stages

    @property
    def chunk_layers(self) -> int:
        """The layers a chunk holds (uneven stages: the largest, the others padded)."""
        return max(self.stage_layer_counts)

    @property
    def backward_parts(self) -> int:
        """The cells a BW is cut into: its cost in F's, at most one per layer of a chunk."""
        return max(1, min(self.remat.backward_in_f, self.chunk_layers))

    @property
    def overlap(self) -> bool:
        return overlapped(self.parallel)

    @cached_property
    def program(self) -> Program:
        p = self.parallel
        return program(p.schedule, p.pipeline, p.microbatches, p.virtual_stages,
                       self.overlap, self.stage_layers, self.backward_parts, p.combined_1f1b)

    # --- The step's tokens on one device ------------------------------------------------
    @property
    def rows_per_replica(self) -> int:
        return self.global_batch // self.parallel.data

    @property
    def rows_per_microbatch(self) -> int:
        return self.rows_per_replica // self.parallel.microbatches

    @property
    def seq_per_device(self) -> int:
        """A device's tokens of a sequence (context parallelism splits it)."""
        return self.seq_len // self.parallel.context

    @property
    def hidden_seq(self) -> int:
        """The sequence length of a device's hidden states between the layers (sequence
        parallelism splits them over `tensor`)."""
        return self.seq_per_device // (self.parallel.tensor if self.sequence_parallel else 1)


def with_stage_layers(model: ModelConfig, parallel: ParallelConfig,
                      seq_len: int | None) -> ParallelConfig:
    """`parallel` with `stage_layers` resolved: `auto` balanced on each stage's training
    FLOPs per token (`layout.balance`; the head's counted, attention causal:
    framework/model/flops.py), and counts that are all equal as None (even)."""
    if parallel.stage_layers is None:
        return parallel
    counts = tuple(parallel.stage_layers)
    if parallel.stage_layers == "auto":
        counts = balance(stack_layers(model), global_stages(parallel),
                         *stage_flops_per_token(model, seq_len))
    return dataclasses.replace(parallel, stage_layers=None if len(set(counts)) == 1 else counts)


@lru_cache(maxsize=None)
def resolved(model: ModelConfig, parallel: ParallelConfig, seq_len: int | None = None,
             global_batch: int | None = None) -> Layout:
    """The Layout of a configuration `validate` accepts (or would: the analyses' own
    layouts), its `auto` stage layers balanced. One per configuration."""
    return Layout(model, with_stage_layers(model, parallel, seq_len), seq_len, global_batch)


def exchange_for(setting: str, platform: str) -> str:
    """`parallel.expert_exchange` for a mesh of `platform` devices (module docstring):
    auto is ragged where the compiler has `ragged_all_to_all` (framework/hardware.py),
    else dense; ragged where it has not is emulated."""
    native = hardware.has_ragged_all_to_all(platform)
    if setting == "auto":
        return "ragged" if native else "dense"
    return "emulated" if setting == "ragged" and not native else setting


def with_exchange(parallel, platform: str):
    """`parallel` (a ParallelConfig) with its expert_exchange resolved for `platform`
    (`exchange_for`): what the engine, the memory model and the executor's state trace.
    Here, not in framework/parallel/expert.py: which compiler has the op is a hardware
    fact (framework/hardware.py), which the parallel package does not read."""
    exchange = exchange_for(parallel.expert_exchange, platform)
    return dataclasses.replace(parallel, expert_exchange=exchange)
