"""The model, written in logical axes: it never sees a mesh.

  llama.py      the Llama decoder (Embed, Block, Head), its parameters and the
                `weight_op` hook every weight use goes through
  attention.py  attention kernels: dense (the reference), blockwise, cuDNN
  ring_attention.py  attention over a sequence split over devices (context parallelism)
  reference.py  the naive single-device model and step every parallel path is tested
                against
"""
