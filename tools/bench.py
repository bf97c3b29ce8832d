"""Steady-state speed of the framework against the plain JAX step, layout by layout.

    python tools/bench.py recipe=llama_small_3d
    python tools/bench.py recipe=llama_small_3d parallel.tensor=2 \\
        --layout 4,2,1:microbatches=8:schedule=1f1b
    python tools/bench.py recipe=llama_tiny_debug --steps 3 --rounds 2 --markdown bench.md
    python tools/bench.py recipe=llama_1b_1gpu devices.platform=gpu

For each layout (default: 1,1,1 2,1,1 1,2,1 1,1,2 2,2,2, the recipe's own, then every
`--layout P,D,T[:field=value...]`) it compiles the engine's step once (compilation
excluded from every timing) and, in the same process, the naive single-device
reference step (`framework/model/reference.py`). Timing survives a noisy shared machine:
every runner gets `--rounds` blocks of `--steps` individually timed steps, the blocks
of all runners interleaved (in a shuffled order per round) after one untimed step, and
the table quotes medians. The framework/reference ratio at (1,1,1) is the median over
`--pairs` back-to-back pairs of one framework and one reference step (which one goes
first alternates): on a machine whose load changes from second to second, only
neighbouring steps see the same machine.

MFU: on accelerators against the peak table (`framework/analysis/flops.py`); on CPU against
the host's float32 matmul peak, measured once here (simulated devices share the host's
cores, so there their rows show the parallel program's overhead, never a speed-up).
Compile time: the step of the recipe's model traced and compiled with 4 and with 32
layers, at (1,1,1) and at the recipe's layout (layers are scanned, so 32 layers should
cost at most 1.5x what 4 cost); on CPU by default (`--compile-reps`).

`--profile`: the recipe's layout profiled too (`jax.profiler`): its device time per kind
of kernel (matmuls, attention, copies and slices, collectives, elementwise), kernels per
step and the top ops (framework/analysis/device_time.py).

Attention: `--attention dense,blockwise,cudnn` (the default on GPUs) adds a row per
kernel at the recipe's layout (`model.attention`; the first rows run `auto`). Before a
row is built its memory is predicted (`framework/analysis/memory_model.py`) and checked against
the device's limit (`framework/analysis/memory_check.py`): a row that would not fit is reported
as skipped, with its prediction, instead of failing. On CPU the laptop row (`--laptop`,
the default there): 4 layers, d_model 128, seq 64, batch 12 at (1,1,1) and its plain JAX
reference, the shape of the issue's PyTorch comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from framework.analysis.device_time import ungraphed  # noqa: E402
from framework.runtime.quiet import import_jax  # noqa: E402

UNGRAPHED = ungraphed(sys.argv)  # --profile: CUDA graphs off (its note, else "")
import_jax()  # before anything imports JAX: its plugins' start-up lines stay off stderr

from tools.recipe import compose, user_error  # noqa: E402
from tools.bench_measure import Timing, compile_times, measure, peak_for, profile  # noqa: E402
from tools.bench_report import LAPTOP, kernel_run, laptop_lines, report  # noqa: E402
from framework.parallel.mesh import mesh_name  # noqa: E402

# This module is the command line: which layouts, attention kernels and extra rows are
# measured. The timing is in tools/bench_measure.py, the Markdown in tools/bench_report.py.
DEFAULT_LAYOUTS = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2))


def parse_layout(spec: str, base):
    """'P,D,T[:field=value...]' -> ParallelConfig on top of `base` (microbatches and
    schedule reset to 1 / gpipe unless given: pipeline > 1 keeps the base's)."""
    from framework.errors import ConfigError
    from framework.config import ParallelConfig

    degrees, *extras = spec.split(":")
    try:
        p, d, t = (int(x) for x in degrees.split(","))
    except ValueError:
        raise ConfigError(f"--layout {spec!r}: expected P,D,T[:field=value...]") from None
    par = dataclasses.replace(base, pipeline=p, data=d, tensor=t)
    if p == 1:
        par = dataclasses.replace(par, microbatches=1, schedule="gpipe", virtual_stages=1)
    types = {f.name: type(getattr(ParallelConfig(), f.name))
             for f in dataclasses.fields(ParallelConfig)}
    for extra in extras:
        key, _, value = extra.partition("=")
        if key not in types:
            raise ConfigError(f"--layout {spec!r}: {key!r} is not a parallel.* field")
        kind = types[key]
        par = dataclasses.replace(par, **{key: value.lower() in ("1", "true", "yes") if kind is bool
                                          else kind(value)})
    return par


def layouts_for(cfg, specs: list[str], defaults: bool) -> list:
    """(1,1,1) with the reference's own settings first (no remat, one microbatch: the
    ratio compares like with like), then the other default layouts, the recipe's own,
    and the command line's; duplicates dropped."""
    base = cfg.parallel
    one = dataclasses.replace(base, pipeline=1, data=1, tensor=1, microbatches=1,
                              schedule="gpipe", virtual_stages=1, remat="none", zero1=False,
                              sequence_parallel=False)
    found = [one]
    if defaults:
        found += [parse_layout(",".join(map(str, d)), base) for d in DEFAULT_LAYOUTS[1:]]
    found.append(base)
    found += [parse_layout(s, base) for s in specs]
    unique = []
    for par in found:
        if par not in unique:
            unique.append(par)
    return unique


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", action="append", default=[],
                        help="P,D,T[:field=value...], e.g. 2,2,2:microbatches=8:schedule=1f1b")
    parser.add_argument("--no-defaults", action="store_true",
                        help="only (1,1,1), the recipe's layout and --layout's")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved blocks per runner")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    parser.add_argument("--pairs", type=int, default=20,
                        help="back-to-back (1,1,1)/reference step pairs for the ratio")
    parser.add_argument("--compile-layers", type=int, nargs=2, default=[4, 32])
    parser.add_argument("--compile-reps", type=int, default=None,
                        help="default: 3 on CPU, 0 (not measured) on accelerators")
    parser.add_argument("--attention", default=None,
                        help="kernels for extra rows at the recipe's layout, e.g. dense,blockwise "
                             "(default: dense,blockwise,cudnn on GPUs, none elsewhere)")
    parser.add_argument("--laptop", action=argparse.BooleanOptionalAction, default=None,
                        help="the laptop row (default: on CPU)")
    parser.add_argument("--markdown", type=Path, help="also write the report here")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the recipe's layout: device time per kind of "
                             "kernel, kernels per step, the top ops")
    return parser


def attention_rows(cfg, devset, kernels: str | None, valid: list) -> list:
    """(recipe's layout, kernel) for each requested attention kernel other than the one
    `auto` (or the recipe) already runs; raises ConfigError for one that cannot run here."""
    from framework.model import attention
    from framework.errors import ConfigError
    from framework.engine.validate import check

    if kernels is None:
        kernels = "dense,blockwise,cudnn" if devset.platform == "gpu" else ""
    own = next((p for p in valid if p == cfg.parallel), valid[0])
    out = []
    for kernel in [k for k in kernels.split(",") if k]:
        model = dataclasses.replace(cfg.model, attention=kernel)
        errs = check(model, own, cfg.train, own.n_devices)
        if kernel == "auto" or errs:
            raise ConfigError(f"--attention {kernel}: " + ("; ".join(errs) or "auto is the "
                                                                            "rows' own kernel"))
        attention.check_platform(model, devset.platform)
        if kernel != kernel_run(cfg, devset):
            out.append((own, kernel))
    return out


def main(argv=None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    from framework.errors import ConfigError

    try:
        cfg, devset, valid = _layouts(overrides, args)
        variants = attention_rows(cfg, devset, args.attention, valid)
    except ConfigError as err:
        return user_error(err)
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # time real compilations
    peak = peak_for(cfg, devset)
    print(f"{peak.source}: {peak.flops / 1e9:.1f} GFLOP/s", flush=True)
    if UNGRAPHED:
        print(UNGRAPHED, flush=True)
    limit = None
    if devset.platform != "cpu":  # simulated CPU devices share the host's memory
        from framework.analysis.memory_check import device_limit

        limit = device_limit(devset)[0]
    skipped = []
    try:
        measured = measure(cfg, valid + variants, devset.devices, _timing(args), limit=limit,
                           skipped=skipped, resident=devset.platform == "cpu")
    except ConfigError as err:
        return user_error(err)
    extra = [f"Skipped {line}." for line in skipped] + _extra_lines(cfg, devset, args)
    compiled = _compile_rows(cfg, devset, args, valid)
    text = report(cfg, devset, args, peak, measured, compiled, extra)
    if args.profile:
        own = next((p for p in valid if p == cfg.parallel), valid[0])
        lines = profile(cfg, own, devset.devices).lines()
        text += f"\n\nProfile of {mesh_name(own)}:\n\n```\n" + "\n".join(lines) + "\n```"
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


def _timing(args) -> Timing:
    """--steps, --rounds, --warmup and --pairs (the order of the blocks: seed 0)."""
    return Timing(steps=args.steps, rounds=args.rounds, warmup=args.warmup, pairs=args.pairs)


def _layouts(overrides: list[str], args):
    """(the composed config, the devices, the layouts that can run on them, validated)."""
    from framework.config import DevicesConfig, ParallelConfig
    from framework.engine.validate import validate
    from framework.runtime import devices as devices_lib

    cfg = compose(overrides)
    layouts = layouts_for(cfg, args.layout, not args.no_defaults)
    wanted = max(par.n_devices for par in layouts)
    devset = devices_lib.start(DevicesConfig(cfg.devices.platform, wanted), ParallelConfig())
    valid = []
    for par in layouts:
        if par.n_devices > len(devset):
            print(f"skipped {mesh_name(par)}: needs {par.n_devices} devices, {len(devset)} here")
            continue
        with warnings.catch_warnings():  # microbatches < pipeline: measured anyway
            warnings.simplefilter("ignore")
            valid.append(validate(cfg.model, par, cfg.train, par.n_devices))
    return cfg, devset, valid


def _extra_lines(cfg, devset, args) -> list[str]:
    """Paragraphs after the ratio: an accelerator's peak memory, the laptop row."""
    from framework.config import ModelConfig, ParallelConfig

    extra = []
    if devset.platform != "cpu":
        used = devset.devices[0].memory_stats() or {}
        if "peak_bytes_in_use" in used:
            extra += [f"Peak memory in use on {devset.kind} (the whole benchmark): "
                      f"{used['peak_bytes_in_use'] / 2**30:.2f} GiB of "
                      f"{used.get('bytes_limit', float('nan')) / 2**30:.2f} GiB."]
    if args.laptop if args.laptop is not None else devset.platform == "cpu":
        small = dataclasses.replace(cfg, model=ModelConfig(), parallel=ParallelConfig(),
                                    train=dataclasses.replace(cfg.train, **LAPTOP))
        extra += laptop_lines(measure(small, [ParallelConfig()], devset.devices[:1],
                                      _timing(args)))
    return extra


def _compile_rows(cfg, devset, args, valid) -> dict:
    """Compile times with few and many layers: the single device, and the recipe's own
    layout if it runs here."""
    from framework.engine.validate import check

    if args.compile_reps is None:
        args.compile_reps = 3 if devset.platform == "cpu" else 0
    compiled = {}
    timed = [valid[0]] + [p for p in valid[1:] if p == cfg.parallel] if args.compile_reps else []
    for par in timed:
        counts = [dataclasses.replace(cfg.model, n_layers=n) for n in args.compile_layers]
        if not any(check(model, par, cfg.train, par.n_devices) for model in counts):
            compiled[mesh_name(par)] = compile_times(
                cfg, par, devset.devices, tuple(args.compile_layers), args.compile_reps)
    return compiled


if __name__ == "__main__":
    sys.exit(main())
