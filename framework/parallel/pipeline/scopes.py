"""Named scopes of the executors' programs: the communication audit weighs the
collectives inside them by how often the table runs them (`Program.scope_weights`,
`framework/analysis/audit.py`), and the profiler finds the tick loops and the cells by
them (`framework/analysis/profiling.py`). One place, so that the programs and their
readers cannot disagree; each cell kind's own scope is a field of its row
(`kinds.CellKind.scope`)."""

from __future__ import annotations

LOOP = "pipeline_loop"  # the tick loop (autodiff: the forward loop; its transpose too)
CELL = "cell"  # the per-tick dispatch on the cell's kind (its conditionals)
STAGE = "stage_work"  # autodiff executor: a rank's busy branch (F cells)
ON_FIRST, ON_LAST = "on_first_stage", "on_last_stage"  # embedding / head + loss
# a microbatch's gradients added into the step's accumulators (the tick executor's cells,
# accumulation without a pipeline): what the compiled program's traffic under it counts
# is what the planner prices per microbatch (`planner.accumulation_seconds`)
ACCUMULATE = "accumulate"


def send_scope(channel, pattern: int) -> str:
    """The scope of one send pattern of a channel (`framework/parallel/pipeline/comm.py`):
    the channel's scope (around its switch over the patterns) and `_<pattern>`, which is
    how the compiled program's reader weighs the switch's branches (`hlo.Program.runs`)."""
    return f"{channel_scope(channel)}_{pattern}"


def channel_scope(channel) -> str:
    """The scope around a channel's switch over its send patterns."""
    return f"send_{channel.buffer}{channel.shift}"
