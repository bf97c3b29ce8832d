"""The parallelisms on one (pipe, data, context, tensor) mesh, one concept per module.

  mesh.py       the mesh and the names of its axes (the one topology object)
  rules.py      the logical-axis -> mesh-axis table: the whole sharding plan
  tensor.py     Megatron tensor (and sequence) parallelism: the plan the model is handed
  data.py       data parallelism: the one gradient reduction per step, ZeRO-1, FSDP
  context.py    context parallelism: the sequence split over devices, for ring attention
  expert.py     expert parallelism: MoE experts split over `expert`, the tokens' all-to-all
  pipeline/     pipeline parallelism: schedule tables, buffers, sends, executors
"""
