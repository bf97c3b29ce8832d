"""Will the run fit? Decided before any parameter is allocated.

On GPUs and TPUs the compiler says it: the step is compiled from abstract inputs first
(the run reuses that program) and its memory analysis (arguments + outputs +
temporaries - aliased, per device) is compared with the limit; the TPU compiler itself
refuses a program over the chip's HBM. On CPU, where compiling a large program for
simulated devices costs more than it tells, the planner's memory model
(`framework/analysis/memory_model.py`: parameters, optimizer state, gradients,
activations per schedule, traced from the model's own layers, no devices used) predicts
the step's peak bytes per device. The limit is the device's:

    GPU / TPU  `bytes_limit` of the device's memory statistics (what XLA's allocator
               may use, after the client's own reservation);
    CPU        the host's available memory (MemAvailable), shared by this process's
               simulated devices.

`devices.memory_limit_gb` replaces the detected limit (e.g. to leave headroom, or to
check for a device you do not have); `devices.memory_check=false` skips the check.
Over the limit, the run stops with one line (exit 2): the prediction, the limit, and
up to three changes that would fit, fastest first by the planner's step-time model
(`framework/analysis/planner.py`): rematerialisation, more pipeline or tensor parallelism,
ZeRO-1, 1F1B (fewer microbatches in flight), blockwise attention, and last a smaller
batch.
"""

from __future__ import annotations

import dataclasses
import os
import re

from framework.errors import ConfigError, MemoryCheckError
from framework.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from framework.engine.resolved import overlapped
from framework.units import GIB, size as _size

SHOWN = 3  # suggestions in the error line


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_limit(devset) -> tuple[float | None, str]:
    """(bytes per device the run may use, where the number comes from); None when the
    device does not say."""
    if devset.platform == "cpu":
        local = max(len(devset) // max(devset.process_count, 1), 1)
        avail = _host_available_bytes()
        share = f" / {local} devices" if local > 1 else ""
        return avail / local, f"{avail / GIB:.1f} GiB of available host memory{share}"
    stats = devset.devices[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None, f"{devset.kind} reports no memory limit"
    return float(stats["bytes_limit"]), f"{devset.kind} bytes_limit"


def _changes(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
             new: tuple[ModelConfig, ParallelConfig, TrainConfig]) -> str:
    """The overrides that turn the run's settings into `new`, e.g. 'parallel.remat=full'."""
    out = []
    for group, old, cand in (("model", model, new[0]), ("parallel", parallel, new[1]),
                             ("train", train, new[2])):
        for f in dataclasses.fields(old):
            if getattr(old, f.name) != getattr(cand, f.name):
                value = getattr(cand, f.name)
                value = str(value).lower() if isinstance(value, bool) else value
                if isinstance(value, tuple):  # Hydra's list syntax
                    value = "[" + ",".join(map(str, value)) + "]"
                out.append(f"{group}.{f.name}={value}")
    return " ".join(out)


def _candidates(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                n_devices: int):
    """Layouts of these devices (the planner's enumeration, with the run's remat and
    with full remat; the run's layout with synchronous sends, which keep fewer
    microbatches in flight), blockwise attention, then halved batches (changing what is
    trained, so they come last)."""
    from framework.analysis import planner

    layouts = []
    for remat in dict.fromkeys([parallel.remat, "full"]):
        base = dataclasses.replace(parallel, remat=remat)
        layouts += planner.enumerate_layouts(model, train, n_devices, base)
        layouts += [base] + ([dataclasses.replace(base, overlap_sends=False)]
                             if overlapped(base) else [])
    models = [model] + ([dataclasses.replace(model, attention="blockwise")]
                        if model.attention == "dense" else [])
    unique = [par for i, par in enumerate(layouts) if par not in layouts[:i]]
    found = [(m, par, train) for m in models for par in unique]
    batch = train.global_batch_size // 2
    while batch >= parallel.data * parallel.microbatches:
        smaller = dataclasses.replace(train, global_batch_size=batch)
        found.append((model, dataclasses.replace(parallel, remat="full"), smaller))
        batch //= 2
    return found


@dataclasses.dataclass(frozen=True)
class Budget:
    """What a suggested layout must fit: `n_devices` devices of `platform` ("cpu", "gpu",
    "tpu") with `limit` bytes each; `kind` names the device (its peak FLOPs rank the
    candidates; "" or unknown: 1 TFLOP/s)."""

    n_devices: int
    limit: float
    platform: str
    kind: str = ""


def suggestions(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                budget: Budget, wanted: int = SHOWN, optim=None) -> list[str]:
    """Up to `wanted` changes predicted to fit under `budget.limit`, fastest first
    ('<overrides> (x GiB)'). The candidates are ranked by the step-time model first
    (cheap) and only then asked for their memory (a trace of the layers each), in that
    order, until `wanted` fit: the same answer as predicting every candidate's memory."""
    from framework import hardware
    from framework.analysis import memory_model, planner
    from framework.engine.validate import check

    peak = hardware.peak_flops(budget.kind, model.dtype) or 1e12
    hw = planner.Hardware(memory_bytes=budget.limit, peak_flops=peak, memory_fraction=1.0,
                          platform=budget.platform, device=budget.kind)
    ranked = []
    for i, (m, par, tr) in enumerate(_candidates(model, parallel, train, budget.n_devices)):
        if not check(m, par, tr, budget.n_devices):
            smaller_batch = tr.global_batch_size != train.global_batch_size
            speed = planner.predict_time(m, par, tr, hw, optim)["total"] / tr.global_batch_size
            ranked.append(((smaller_batch, speed, i), (m, par, tr)))
    found = []
    for _, (m, par, tr) in sorted(ranked, key=lambda r: r[0]):
        total = memory_model.predict_memory(m, par, tr, budget.platform, optim)["total"]
        if total <= budget.limit:
            found.append(f"{_changes(model, parallel, train, (m, par, tr))} ({_size(total)})")
            if len(found) == wanted:
                break
    return found


def _limit(cfg: RunConfig, devset) -> tuple[float | None, str]:
    if cfg.devices.memory_limit_gb is not None:
        if cfg.devices.memory_limit_gb <= 0:
            raise ConfigError(f"devices.memory_limit_gb={cfg.devices.memory_limit_gb} must be > 0 "
                              f"(GiB per device), or null for the device's own limit")
        return cfg.devices.memory_limit_gb * GIB, "devices.memory_limit_gb"
    return device_limit(devset)


def _refuse(cfg: RunConfig, parallel: ParallelConfig, devset, total: float, limit: float,
            source: str, whose: str) -> MemoryCheckError:
    fits = suggestions(cfg.model, parallel, cfg.train,
                       Budget(len(devset), limit, devset.platform, devset.kind), optim=cfg.optim)
    n = len(devset)
    advice = (f"predicted to fit: {'; '.join(fits[:SHOWN])}" if fits else
              f"nothing on {n} device{'s' if n > 1 else ''} is predicted to fit: use more "
              f"devices or a smaller model")
    return MemoryCheckError(
        f"the run needs {_size(total)} per device ({whose}), over the limit of "
        f"{_size(limit)} ({source}); {advice}; devices.memory_check=false skips this check")


def check(cfg: RunConfig, parallel: ParallelConfig, devset) -> dict | None:
    """CPU: raises MemoryCheckError when the run is predicted not to fit the devices;
    returns the prediction and the limit otherwise (None when skipped). On GPUs and
    TPUs the compiled program says it (`check_compiled`). `parallel`: validated."""
    if not cfg.devices.memory_check or devset.platform != "cpu":
        return None
    from framework.analysis import memory_model

    limit, source = _limit(cfg, devset)
    if limit is None:
        return None
    total = memory_model.predict_memory(cfg.model, parallel, cfg.train, devset.platform,
                                        cfg.optim)["total"]
    if total > limit:
        raise _refuse(cfg, parallel, devset, total, limit, source, "predicted by the memory model")
    return {"predicted_bytes": total, "limit_bytes": limit}


# How a TPU compiler's refusal's figure is quoted: its temporaries count the tiles'
# padding twice (`compiled_bytes`), so the program needs less than it says, though more
# than the HBM (it refused it).
TPU_REFUSED = "of temporaries, the TPU compiler's figure, its tiles' padding counted twice"


def hbm_oom(err: Exception) -> tuple[float, float] | None:
    """(bytes needed, bytes available) when the TPU compiler refused a program for lack
    of HBM: "... required for HLO temporaries (119.33G) exceeds available HBM (95.74G)"."""
    m = re.search(r"\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)",
                  str(err))
    if not m:
        return None
    unit = lambda u: 2 ** (10 * "KMGT".index(u) + 10)
    return float(m.group(1)) * unit(m.group(2)), float(m.group(3)) * unit(m.group(4))


def compiled_bytes(compiled, platform: str) -> int:
    """What the step holds at its high-water mark per device, the compiler's figure.
    GPU and CPU: arguments + outputs + temporaries - aliased (the donated state counted
    once; the GPU's own peak agrees within 1%, the CPU's leaves the temporaries out).
    TPU: the compiler's peak. Its temporaries count the tiles' padding twice (libtpu
    logs "HLO temp 7.31G (Unpadded 4.16G, 43.1% fragmentation (3.15G))" for a step whose
    temp_size_in_bytes is 10.46G), and the peak is what its own fit check reads:
    llama3_8b_v5p, ZB-H1, 384 sequences on tpu:v5p-32 compiles at a peak of 90.1 GiB of
    95.74 where the sum says 105.2; 448 sequences it refuses (docs/compile.md)."""
    mem = compiled.memory_analysis()
    if platform == "tpu":
        return int(mem.peak_memory_in_bytes)
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes
               + mem.temp_size_in_bytes - mem.alias_size_in_bytes)


def check_compiled(cfg: RunConfig, engine, devset) -> dict | None:
    """GPU / TPU: compiles the step from abstract inputs (nothing allocated yet; the
    run reuses the program) and refuses it, like `check`, when the compiler's own
    memory analysis is over the device's limit (TPU: when the compiler refuses it)."""
    if not cfg.devices.memory_check or devset.platform == "cpu":
        return None
    limit, source = _limit(cfg, devset)
    state, tokens = engine.abstract_inputs(cfg.train.global_batch_size, cfg.train.seq_len)
    try:
        engine.compile(state, tokens)
    except Exception as err:  # XLA's error type differs between jaxlib versions
        oom = hbm_oom(err)
        if oom is None:
            raise
        raise _refuse(cfg, engine.parallel, devset, oom[0], oom[1], "the TPU's HBM",
                      TPU_REFUSED) from None
    total = compiled_bytes(engine.compiled, devset.platform)
    if limit is not None and total > limit:
        raise _refuse(cfg, engine.parallel, devset, total, limit, source, "the compiler's figure")
    return {"compiled_bytes": total, "limit_bytes": limit}
