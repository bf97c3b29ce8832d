"""The compiled steps on the mesh, from a validated configuration.

  validate.py   can this (model, parallel, train) be built on these devices?
  state.py      the train state's one constructor and its two layouts (train, canonical)
  step.py       the pure train step, in named pieces (one shard_map over the mesh)
  split.py      the zero-bubble split backward (B and W halves)
  optim.py      AdamW, warmup and cosine decay, clipping
  build.py      the engine: the jitted step and its state layout for one run
  decode.py     the KV-cache decoding step (generation)
"""
