"""Multi-host runs: one process per host (or per GPU), all in one JAX mesh.

Whether and how `jax.distributed.initialize` is called (`plan`), from `distributed.*`
and the environment:

    num_processes unset (default)  one process, unless this process is one task of a
                                   multi-task SLURM step (`srun --ntasks=N`, N > 1):
                                   then JAX reads everything from SLURM's variables
    num_processes = 1              one process; never initializes (even under SLURM)
    num_processes = -1             always initializes and lets JAX detect the cluster
                                   (SLURM, Cloud TPU, Open MPI, ...); coordinator_address
                                   and process_id, when set, win over what it detects
    num_processes = N > 1          explicit: coordinator_address (host:port of process 0)
                                   and process_id (0..N-1) must be set too

Initialization must come before anything starts a JAX backend (`devices.start` calls
`initialize` right after fixing the simulated CPU device count). Afterwards
`jax.devices()` lists every process's devices and one mesh spans them; each process
feeds only its own devices. CPU processes talk over gloo (JAX's default), so
`2 processes x 4 simulated CPU devices` on one machine form the same 8-device mesh as
one process with 8.

Only process 0 writes metrics.jsonl, summary.json and W&B (`is_primary`); every
process takes part in every step, evaluation and checkpoint. Decisions that read the
filesystem (which checkpoint to resume from, the run folder) are taken by process 0 and
broadcast (`agree`), so the processes cannot diverge on them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping

from framework.errors import ConfigError
from framework.config import DistributedConfig

AUTO = -1  # distributed.num_processes=-1: let JAX detect the cluster


@dataclass(frozen=True)
class Plan:
    """Arguments for jax.distributed.initialize (None: JAX detects it)."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    source: str  # "config", "slurm" or "detect"
    heartbeat_timeout_s: int = 100


def _slurm_tasks(environ: Mapping[str, str]) -> int | None:
    """Task count of the `srun` step this process is a task of. Only srun sets the
    SLURM_STEP_* variables: a batch script itself (which has SLURM_NTASKS and
    SLURM_PROCID=0 too) is one process."""
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NODELIST" not in environ:
        return None
    tasks = environ.get("SLURM_STEP_NUM_TASKS", "")
    return int(tasks) if tasks.isdigit() else None


def plan(cfg: DistributedConfig, environ: Mapping[str, str] = os.environ) -> Plan | None:
    """None for a single-process run, else how to initialize (see the module docstring).
    Raises ConfigError for inconsistent settings."""
    n, pid, address = cfg.num_processes, cfg.process_id, cfg.coordinator_address
    if cfg.heartbeat_timeout_s < 1:
        raise ConfigError(f"distributed.heartbeat_timeout_s={cfg.heartbeat_timeout_s} must "
                          f"be >= 1 (seconds; JAX's default is 100)")
    if n is None:
        if address is not None or pid is not None:
            raise ConfigError("distributed.coordinator_address/process_id are set but "
                              "distributed.num_processes is not: set it to the number of "
                              "processes (or -1 to detect it from the cluster)")
        tasks = _slurm_tasks(environ)
        return (Plan(None, None, None, "slurm", cfg.heartbeat_timeout_s)
                if tasks and tasks > 1 else None)
    if n == AUTO:
        return Plan(address, None, pid, "detect", cfg.heartbeat_timeout_s)
    if n < 1:
        raise ConfigError(f"distributed.num_processes={n} must be >= 1, or -1 to detect it "
                          f"from the cluster (SLURM, Cloud TPU, Open MPI)")
    if n == 1:
        if pid not in (None, 0):
            raise ConfigError(f"distributed.process_id={pid} but distributed.num_processes=1")
        return None
    missing = [name for name, value in (("coordinator_address", address),
                                        ("process_id", pid)) if value is None]
    if missing:
        raise ConfigError(f"distributed.num_processes={n} needs "
                          f"{' and '.join('distributed.' + m for m in missing)} on every "
                          f"process (coordinator_address: host:port of process 0; "
                          f"process_id: 0..{n - 1}), or num_processes=-1 on a cluster "
                          f"JAX can detect")
    if not 0 <= pid < n:
        raise ConfigError(f"distributed.process_id={pid} must be in 0..{n - 1} "
                          f"(distributed.num_processes={n})")
    if ":" not in address:
        raise ConfigError(f"distributed.coordinator_address={address} must be host:port "
                          f"(e.g. 10.0.0.1:1234, reachable from every process)")
    return Plan(address, n, pid, "config", cfg.heartbeat_timeout_s)


def expected_processes(p: Plan | None, environ: Mapping[str, str] = os.environ) -> int | None:
    """How many processes the run will have, when known before initializing (used to
    split simulated CPU devices among them)."""
    if p is None:
        return 1
    if p.num_processes is not None:
        return p.num_processes
    return _slurm_tasks(environ)


def initialize(p: Plan | None) -> None:
    """Connects this process to the others (no-op for a single-process run). Must run
    before anything starts a JAX backend."""
    if p is None:
        return
    import jax

    try:
        jax.distributed.initialize(coordinator_address=p.coordinator_address,
                                   num_processes=p.num_processes, process_id=p.process_id,
                                   heartbeat_timeout_seconds=p.heartbeat_timeout_s)
    except (RuntimeError, ValueError, TypeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        who = (f"process {p.process_id} of {p.num_processes} via {p.coordinator_address}"
               if p.source == "config" else f"settings detected from the environment ({p.source})")
        raise ConfigError(f"distributed: jax.distributed.initialize failed for {who}: "
                          f"{first}") from None


def process_index() -> int:
    import jax

    return jax.process_index()


def is_primary() -> bool:
    """Process 0: the one that writes metrics, summary and W&B."""
    return process_index() == 0


MAX_MESSAGE_BYTES = 1 << 16


def agree(value):
    """Process 0's `value` (anything JSON can hold) on every process."""
    import jax

    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    raw = json.dumps(value).encode()
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ValueError(f"agree(): {len(raw)} bytes is more than {MAX_MESSAGE_BYTES}")
    buf = np.zeros(MAX_MESSAGE_BYTES, np.uint8)
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    out = multihost_utils.broadcast_one_to_all({"n": np.int32(len(raw)), "buf": buf})
    return json.loads(bytes(np.asarray(out["buf"])[:int(out["n"])]).decode())


def first_error(message: str | None) -> str | None:
    """The first non-empty `message` by process index, on every process (None when no
    process has one): a verdict every process acts on alike, e.g. a checkpoint that one
    process could not read."""
    import jax

    if jax.process_count() == 1:
        return message or None
    import numpy as np
    from jax.experimental import multihost_utils

    raw = (message or "").encode()[:MAX_MESSAGE_BYTES]
    buf = np.zeros(MAX_MESSAGE_BYTES, np.uint8)
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buf))  # [processes, bytes]
    for row in rows.reshape(jax.process_count(), MAX_MESSAGE_BYTES):
        text = bytes(row).rstrip(b"\0").decode(errors="replace")
        if text:
            return text
    return None
