"""Checkpoints of the train state.

  manager.py    saving and restoring, asynchronous and atomic; failed saves noticed
  integrity.py  fingerprints of every array; damaged steps moved aside
  paths.py      what a run, checkpoint or step folder path holds
"""
