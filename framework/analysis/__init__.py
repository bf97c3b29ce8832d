"""What a program costs, measured from the compiled program or predicted without one.

  hlo.py           reading compiled programs' text
  audit.py         every collective of a compiled step, bytes per mesh axis
  profiling.py     the pipeline bubble timed on the devices' own timeline
  flops.py         model FLOPs per token, accelerator peaks, MFU
  comm_model.py    bytes per mesh axis the math requires
  memory_model.py  bytes per device, predicted by tracing the model
  planner.py       every layout of a device count, ranked
  memory_check.py  will the run fit? Decided before anything is allocated
"""
