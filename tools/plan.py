"""Rank the parallel layouts of a recipe for a cluster, before running anything.

    python tools/plan.py recipe=llama_1b_8gpu devices=64 device_memory_gb=80
    python tools/plan.py recipe=llama_small_3d devices=8 device_memory_gb=16 \\
        peak_tflops=100 tensor_gbps=300 pipe_gbps=25 data_gbps=25 parallel.remat=full
    python tools/plan.py recipe=llama3_70b devices=64 --verify target=gpu:h100x64

Enumerates every valid (pipeline, data, tensor, microbatches, schedule, zero1) for
`devices` devices, predicts per-device memory (as the GPU compiler lays it out, or
--verify's target's compiler) and step time (framework/analysis/planner.py: no
devices needed, nothing is compiled) and prints them ranked, fastest first, with the
layouts that do not fit in `device_memory_gb` marked NO. Other `key=value` arguments are
the usual Hydra overrides (remat and sequence parallelism are taken from them).

Settings (all optional except devices and device_memory_gb):
  peak_tflops      dense peak per device; default: --verify's target's device, else
                   H100 SXM, for the model's dtype. Without it the compute time runs at
                   the rates a GPU measured of such stages where there are some
                   (framework/analysis/calibration.py: H200, also used for H100s), else
                   at the peak
  tensor_gbps, pipe_gbps, data_gbps   link bandwidth per device per direction (GB/s);
                   default: the device's in-node link (H100: 450, NVLink 4) while an
                   axis stays inside a node of devices_per_node devices, else
                   network_gbps
  network_gbps     default: the device's (50: one 400 Gb/s InfiniBand link per GPU)
  devices_per_node default: the device's (8)
  memory_fraction  share of device memory XLA may fill (default 0.9)
  (the defaults are the device catalogue's, framework/hardware.py)
  top              fitting layouts shown (default 20); unfit: non-fitting shown (5)

--verify target=<target> (any target of `python -m framework.compile`: gpu:h100x64,
tpu:v5p-256, ...) compiles the verify_top (default 3) best candidates with that
target's compiler and ranks them by whether the compiler fits them, then by predicted
step time (tools/plan_verify.py); devices and device_memory_gb default to the
target's. Each compile takes minutes at 70B on a laptop.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from framework.runtime.quiet import start_cpu_only  # noqa: E402

start_cpu_only()  # nothing here runs on a device  # before anything imports JAX: its plugins' start-up lines stay off stderr

from framework.units import size as _size  # noqa: E402
from tools.recipe import compose, split_settings, user_error  # noqa: E402

SETTINGS = {"devices": int, "device_memory_gb": float, "peak_tflops": float,
            "tensor_gbps": float, "pipe_gbps": float, "data_gbps": float,
            "network_gbps": float, "devices_per_node": int, "memory_fraction": float,
            "top": int, "unfit": int, "target": str, "verify_top": int}
# What each setting may be: (lowest, highest, lowest included), for the one-line error.
POSITIVE = (0, None, False)
VALID = {"devices": (1, None, True), "device_memory_gb": POSITIVE, "peak_tflops": POSITIVE,
         "tensor_gbps": POSITIVE, "pipe_gbps": POSITIVE, "data_gbps": POSITIVE,
         "network_gbps": POSITIVE, "devices_per_node": (1, None, True),
         "memory_fraction": (0, 1, False), "top": (0, None, True), "unfit": (0, None, True),
         "verify_top": (1, None, True)}


def check_settings(settings: dict) -> None:
    """Raises ConfigError (one line) for the first setting out of its range (`VALID`)."""
    from framework.errors import ConfigError

    for name, value in settings.items():
        if name not in VALID:
            continue
        if not math.isfinite(value):
            raise ConfigError(f"{name}={value:g} is not a finite number")
        low, high, closed = VALID[name]
        if (value < low if closed else value <= low) or (high is not None and value > high):
            rng = (f"in ({low}, {high}]" if high is not None else
                   f">= {low}" if closed else f"> {low}")
            raise ConfigError(f"{name}={value:g} is out of range: it must be {rng}")


def check_choices(cfg) -> None:
    """Raises ConfigError (one line) for a setting outside its valid values (`CHOICES`),
    which the planner would otherwise only answer with "no valid layout"."""
    from framework.config import CHOICES, not_one_of
    from framework.errors import ConfigError

    for key in CHOICES:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part, None)
        problem = not_one_of(key, value) if value is not None else None
        if problem:
            raise ConfigError(problem)


def hardware(settings: dict, dtype: str, target=None):
    """The planner's hardware: `target`'s (--verify) device peak unless peak_tflops
    says, else an H100's."""
    from framework import hardware as catalogue
    from framework.analysis import planner
    from framework.errors import ConfigError
    from framework.units import GB, GIB

    device = target.device_name if target is not None else catalogue.DEFAULT
    peak = settings.get("peak_tflops")
    peak = peak * 1e12 if peak else catalogue.peak_flops(device, dtype)
    if peak is None:
        raise ConfigError(f"no {dtype} peak is known for {device}: give peak_tflops=<value>")
    known = catalogue.accelerator(device) or catalogue.accelerator(catalogue.DEFAULT)
    pinned = tuple((axis, settings[f"{axis}_gbps"] * GB)
                   for axis in ("tensor", "pipe", "data") if f"{axis}_gbps" in settings)
    return planner.Hardware(
        memory_bytes=settings["device_memory_gb"] * GIB, peak_flops=peak,
        fp8_peak_flops=None if "peak_tflops" in settings
        else catalogue.peak_flops(device, catalogue.FP8),
        intra_node=known.link_bytes,
        inter_node=settings["network_gbps"] * GB if "network_gbps" in settings
        else known.network_bytes,
        devices_per_node=settings.get("devices_per_node", known.per_node),
        axis_bandwidth=pinned,
        memory_fraction=settings.get("memory_fraction", catalogue.USABLE_FRACTION),
        memory_bandwidth=known.memory_bandwidth,
        platform=target.platform if target is not None else "gpu",
        device=None if "peak_tflops" in settings else device)


def rank_layouts(settings: dict, overrides: list[str], target):
    """(the composed config, the hardware, every valid layout ranked), saying first that
    ranking can take a while."""
    from framework.analysis import planner

    cfg = compose(overrides)
    check_choices(cfg)
    hw = hardware(settings, cfg.model.dtype, target)
    print(f"ranking every layout of this model for {settings['devices']} devices (a minute "
          f"or more for large device counts) ...", flush=True)
    return cfg, hw, planner.plan(cfg.model, cfg.train, cfg.parallel, settings["devices"], hw,
                                 cfg.optim)


def main(argv=None) -> int:
    from framework.errors import ConfigError
    from framework.parallel.mesh import mesh_name

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    verifying = "--verify" in argv
    argv = [a for a in argv if a != "--verify"]
    try:
        settings, overrides = split_settings(argv, SETTINGS)
        target = _target(settings, verifying)
        missing = [k for k in ("devices", "device_memory_gb") if k not in settings]
        if missing:
            raise ConfigError(f"missing {' and '.join(f'{k}=<value>' for k in missing)} "
                              f"(e.g. devices=8 device_memory_gb=80)")
        check_settings(settings)
        cfg, hw, plans = rank_layouts(settings, overrides, target)
    except ConfigError as err:
        return user_error(err)
    if not plans:
        return user_error(ConfigError(f"no valid layout of this model for "
                                      f"{settings['devices']} devices"))
    m, t = cfg.model, cfg.train
    n_fit = sum(pl.fits for pl in plans)
    print(f"{m.n_layers} layers, d_model {m.d_model}, vocab {m.vocab_size}, {m.dtype}; "
          f"batch {t.global_batch_size} x {t.seq_len} tokens; remat {cfg.parallel.remat}"
          f"{', sequence parallel' if cfg.parallel.sequence_parallel else ''}")
    print(f"{settings['devices']} devices x {settings['device_memory_gb']:g} GiB "
          f"(usable {hw.memory_fraction:.0%}), peak {hw.peak_flops / 1e12:.1f} TFLOP/s per "
          f"device; {len(plans)} valid layouts, {n_fit} fit")
    from framework.analysis import planner

    print(planner.table(plans, settings.get("top", 20), settings.get("unfit", 5)))
    print("mem: predicted peak per device = state (parameters, AdamW moments, tokens) + "
          "grads + acts (kept residuals + the largest transient); step ms = compute "
          "(bubble included) + accum (the gradient accumulation's memory traffic at the "
          "device's HBM bandwidth) + tensor + pipe + data communication, no overlap assumed "
          "but of overlapped stage-to-stage sends (parallel.overlap_sends) and of the "
          "collective matmuls' transfers their blocks' matmuls outlast "
          "(parallel.collective_matmul).")
    print(pipeline_verdict(plans))
    own = cfg.parallel if cfg.parallel.data > 1 else dataclasses.replace(  # (one replica:
        cfg.parallel, zero1=False, fsdp=False)  # nothing to shard, ranked as unsharded)
    mine = next((pl for pl in plans if pl.parallel == own), None)
    if mine is not None:
        rank = plans.index(mine) + 1
        print(f"the recipe's own layout ({mesh_name(cfg.parallel)}) ranks {rank} of {len(plans)}: "
              f"{_size(mine.memory['total'])} per device "
              f"({'fits' if mine.fits else 'does NOT fit'}), {mine.time['total'] * 1e3:.4g} ms per step")
    if target is not None:
        from tools import plan_verify

        try:
            verified = plan_verify.verify(plans, cfg, target, settings.get("verify_top", 3))
        except ConfigError as err:
            return user_error(err)
        print(plan_verify.table(verified, target.name), flush=True)
    return 0


def pipeline_verdict(plans: list) -> str:
    """One line: the fastest fitting layout with a pipeline against the fastest without
    one (data, FSDP, context and tensor parallelism only, MaxText's way), by rank and
    predicted step time, and how much faster the better is."""
    from framework.parallel.mesh import mesh_name

    def best(with_pipeline: bool):
        return next(((rank, pl) for rank, pl in enumerate(plans, 1)
                     if pl.fits and (pl.parallel.pipeline > 1) == with_pipeline), None)

    def say(kind: str, found) -> str:
        if found is None:
            return f"no layout {kind} fits"
        rank, pl = found
        return f"{kind}: {mesh_name(pl.parallel)} ranks {rank}, {pl.time['total'] * 1e3:.4g} ms"

    piped, flat = best(True), best(False)
    line = f"{say('with a pipeline', piped)}; {say('without a pipeline', flat)}"
    if piped is None or flat is None:
        return line
    a, b = piped[1].time["total"], flat[1].time["total"]
    return line + (f": the pipeline is {(b / a - 1) * 100:.1f}% faster" if a <= b else
                   f": the layout without one is {(a / b - 1) * 100:.1f}% faster")


def _target(settings: dict, verifying: bool):
    """--verify's compile target (None without --verify); its devices and memory are
    the defaults of devices and device_memory_gb."""
    from framework.errors import ConfigError

    if "target" in settings and not verifying:
        raise ConfigError("target= is for --verify: add --verify, or drop target=")
    if not verifying:
        return None
    if "target" not in settings:
        raise ConfigError("--verify needs target=<target> (e.g. target=gpu:h100x64)")
    from framework.compile.targets import parse

    target = parse(settings["target"])
    if target.platform == "local":
        raise ConfigError("--verify target=local: name a cluster (e.g. target=gpu:h100x64)")
    settings.setdefault("devices", target.n_devices)
    settings.setdefault("device_memory_gb", target.device_bytes / 2**30)
    if settings["devices"] != target.n_devices:
        raise ConfigError(f"devices={settings['devices']} but target={target.name} has "
                          f"{target.n_devices}: leave devices out or make them agree")
    return target


if __name__ == "__main__":
    sys.exit(main())
