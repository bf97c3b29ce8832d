"""The command lines and what a run does from start to finish.

  __main__.py   `python -m framework.run`
  cli.py        Hydra: recipes, overrides, sweeps, one-line errors
  train.py      one training run, in the order it happens
  start.py      where a run starts: checkpoints, init_from, fallbacks
  loop.py       the training loop around the pure step
  hooks.py      what hangs off the loop: batches, evaluation, samples, checkpoints
  tracking.py   metrics.jsonl, summary.json, the progress bar, W&B
  sinks.py      which records a run writes (make_tracker); TensorBoard
  sweep.py      multirun: one process per job
  generate.py   `python -m framework.generate`
"""
