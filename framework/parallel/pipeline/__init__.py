"""Pipeline parallelism.

  table.py      what a table is made of: cells (one integer encoding), the dependency
                rule (`needs`, defined once), the stage map, the `Schedule` table
  simulate.py   the lockstep simulator: per-rank programs -> a table
  schedule.py   the registry of schedules (a new schedule is one generator)
  buffers.py    the stash and receive slots and the point-to-point sends a table
                implies, and the check that replays it
  program.py    a schedule compiled once (`Program`): table, stage map, buffer plan,
                scan inputs, scope weights, sends; what every reader below reads
  stage.py      the stage contract: what an executor needs from the model (`StageFns`,
                the split backward) and the autodiff tools on it (`skip_unless`, ...)
  comm.py       sends and per-rank control flow
  scopes.py     the named scopes the audit and the profiler read
  autodiff.py   executor: runs a table's forward rows, JAX autodiff the backward
                (GPipe, circular)
  ticks.py      executor: runs every cell of any table itself (1F1B, interleaved 1F1B,
                zero-bubble), backward included; its stash in `stash.py`
  layout.py     which layers live on which rank and chunk

Both executors have one interface, `loss_and_grads(program, fns, params, inputs,
targets) -> (loss, grads)` (`Program.autodiff` says which), and get the model as `StageFns`.
"""
