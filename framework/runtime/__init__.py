"""The machine a run is on, set up before JAX starts and watched while it runs.

  devices.py      which devices (simulated CPU devices, GPUs, TPUs) and the process
                  settings that must precede the backend
  distributed.py  several processes in one mesh (jax.distributed, SLURM)
  faults.py       signals from the first instant, stop requests, library output
  peers.py        a vanished process of a multi-process run, said in one line
  runlock.py      one run per folder, also on shared filesystems
"""
