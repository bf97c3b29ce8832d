"""Pipeline parallelism: a schedule planned on the host (numpy), executed on the devices
(JAX). Planning never imports execution (tests/unit/test_tables.py checks the arrow).

Planning
  kinds.py      the cell kinds as one table (`CellKind`: names, cost, what each waits
                for, what it makes, its scope and colour) and the dependency rule
                (`needs`, defined once; when a message arrives, `stored_at`)
  table.py      the stage map and the `Schedule` table (tick, rank) -> cell
  simulate.py   the lockstep simulator: per-rank programs -> a table
  schedule.py   the registry of schedules (a new schedule is one generator)
  actions.py    a table as per-rank action lists (torch.pipelining's CSV), both ways
  buffers.py    the stash and receive slots and the point-to-point sends a table
                implies, and the check that replays it
  program.py    a schedule compiled once (`Program`): table, stage map, buffer plan,
                scan inputs, the branches each tick opens and their scope weights,
                sends; what every reader below reads
  scopes.py     the named scopes the audit and the profiler read
  layout.py     which layers live on which rank and chunk

Execution
  stage.py      the stage contract: what an executor needs from the model (`StageFns`,
                the split backward) and the autodiff tools on it (`skip_unless`, ...)
  comm.py       sends and per-rank control flow
  autodiff.py   executor: runs a table's forward rows, JAX autodiff the backward
                (GPipe, circular)
  ticks.py      executor: runs every cell of any table itself (1F1B, interleaved 1F1B,
                zero-bubble), backward included: the tick loop
  cells.py      ... what each kind of cell does to the tick state (`Cells.work`)
  lowering.py   ... how a cell's conditional is lowered for the compiler
  tick_types.py ... what flows through a tick; stash.py: the stash slots

Both executors have one interface, `loss_and_grads(program, fns, params, inputs,
targets) -> (loss, grads)` (`Program.autodiff` says which), and get the model as `StageFns`.
"""
