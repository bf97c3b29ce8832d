"""Named scopes of the executors' programs: the communication audit weighs the
collectives inside them by how often the table runs them (`scope_weights` of each
executor, `framework/analysis/audit.py`), and the profiler finds the tick loops and
the cells by them (`framework/analysis/profiling.py`). One place, so that the programs
and their readers cannot disagree."""

from __future__ import annotations

from framework.parallel.pipeline.table import BW, BW_PARTS, B, F, W

LOOP = "pipeline_loop"  # the tick loop (autodiff: the forward loop; its transpose too)
CELL = "cell"  # the per-tick dispatch on the cell's kind (a conditional)
STAGE = "stage_work"  # autodiff executor: a rank's busy branch (F cells)
CELL_SCOPES = {F: "cell_forward", B: "cell_input_grad", W: "cell_weight_grad",
               BW: "cell_backward",  # tick executor: each kind's branch
               **{kind: f"cell_backward_part{j}" for j, kind in enumerate(BW_PARTS)}}
ON_FIRST, ON_LAST = "on_first_stage", "on_last_stage"  # embedding / head + loss


def send_scope(channel, pattern: int) -> str:
    """The scope of one send pattern of a channel (`framework/parallel/pipeline/comm.py`)."""
    return f"send_{channel.buffer}{channel.shift}_{pattern}"
