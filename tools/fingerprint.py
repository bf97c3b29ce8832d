"""Fingerprints of what a refactor must not change: the lowered train step of every
schedule and send mode at the scale recipes, on their GPU and TPU targets, the memory
model's prediction and the planner's time for each, and one planner table.

    python tools/fingerprint.py --out before.json        # on the commit before
    python tools/fingerprint.py --out after.json         # after the change
    python tools/fingerprint.py --compare before.json after.json

A program's fingerprint is the SHA-256 of its lowered StableHLO (no compilation: the
text JAX hands the compiler) and of the sorted names of its locations (the named
scopes the audit and the profiler read; file and line locations left out, since moving
code moves them). Lowering needs the `aot` extra's compile-only devices only. A case the
configuration refuses is recorded as its one-line error. `--quick`: one recipe, GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from framework.runtime.quiet import start_cpu_only  # noqa: E402

start_cpu_only()

from tools.recipe import compose  # noqa: E402

# (recipe, target): the programs the byte-identity checks of docs/architecture.md name.
CASES = (("llama_1b_8gpu", "gpu:h100x8"), ("llama_1b_8gpu", "tpu:v5p-16"),
         ("llama3_8b", "gpu:h100x8"), ("llama3_8b_v5p", "tpu:v5p-32"),
         ("llama3_70b", "gpu:h100x64"), ("llama3_70b_v5p", "tpu:v5p-128"))
QUICK = CASES[:1]
# A name location: loc("jit(step)/.../cell_forward") but not a file one, loc("x.py":12:3)
_NAME_LOC = re.compile(r'loc\("((?:[^"\\]|\\.)*)"(?!:\d)')


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _variants(schedule_names):
    """(schedule, overlap_sends) of every schedule with both sends (GPipe and circular
    ignore the setting: their two programs are the same)."""
    for name in schedule_names:
        for sends in (True, False):
            yield name, sends


def lowered(cfg, devices, target) -> dict:
    from framework.compile.targets import cudnn_of
    from framework.engine.build import build_engine
    from framework.engine.validate import validate
    from framework.parallel.mesh import make_mesh

    parallel = validate(cfg.model, cfg.parallel, cfg.train, len(devices))
    engine = build_engine(cfg.model, parallel, cfg.optim, cfg.train.steps,
                          make_mesh(parallel, devices))
    state, tokens = engine.abstract_inputs(cfg.train.global_batch_size, cfg.train.seq_len)
    with cudnn_of(target):
        low = engine.step_fn.lower(state, tokens)
    names = sorted(set(_NAME_LOC.findall(low.as_text(debug_info=True))))
    return {"hlo": _sha(low.as_text()), "scopes": _sha("\n".join(names)),
            "n_scopes": len(names)}


def predicted(cfg, platform: str, kind: str, n_devices: int) -> dict:
    from framework.compile.program import predictions
    from framework.engine.validate import validate

    parallel = validate(cfg.model, cfg.parallel, cfg.train, n_devices)
    out = predictions(cfg.model, parallel, cfg.train, platform, kind, n_devices, cfg.optim)
    from framework.analysis import memory_model

    out["memory"] = memory_model.predict_memory(cfg.model, parallel, cfg.train, platform,
                                                cfg.optim)
    return json.loads(json.dumps(out, default=float))


def fingerprint_case(recipe: str, target_name: str, programs: bool) -> dict:
    from framework.compile.targets import compile_devices, parse
    from framework.errors import ConfigError
    from framework.parallel.pipeline.schedule import schedule_names, uses_virtual_stages

    target = parse(target_name)
    devices = compile_devices(target) if programs else None
    kind = str(devices[0].device_kind) if devices else target.device_name
    out = {}
    for name, sends in _variants(schedule_names()):
        overrides = [f"recipe={recipe}", f"parallel.schedule={name}"]
        if not uses_virtual_stages(name):
            overrides.append("parallel.virtual_stages=1")
        elif compose([f"recipe={recipe}"]).parallel.virtual_stages == 1:
            overrides.append("parallel.virtual_stages=2")  # interleaved, not 1F1B again
        overrides.append(f"parallel.overlap_sends={str(sends).lower()}")
        key = f"{recipe}@{target_name}:{name}:" + ("overlapped" if sends else "synchronous")
        cfg = compose(overrides)
        start = time.perf_counter()
        try:
            entry = predicted(cfg, target.platform, kind, target.n_devices)
            if programs:
                entry.update(lowered(cfg, devices, target))
        except ConfigError as err:
            entry = {"refused": str(err)}
        print(f"{key}: {time.perf_counter() - start:.1f} s {entry.get('hlo', '')}",
              file=sys.stderr, flush=True)
        out[key] = entry
    return out


def planner_table() -> str:
    from framework.analysis import planner

    cfg = compose(["recipe=llama_1b_8gpu"])
    hw = planner.Hardware(memory_bytes=80 * 2**30, peak_flops=989e12)
    base = dataclasses.replace(cfg.parallel)
    plans = planner.plan(cfg.model, cfg.train, base, 8, hw, cfg.optim)
    return planner.table(plans, top=40, unfit=10)


def compare(before: dict, after: dict) -> int:
    bad = 0
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            bad += 1
            print(f"differs: {key}")
            a, b = before.get(key), after.get(key)
            if isinstance(a, dict) and isinstance(b, dict):
                for k in sorted(set(a) | set(b)):
                    if a.get(k) != b.get(k):
                        print(f"    {k}: {str(a.get(k))[:200]} -> {str(b.get(k))[:200]}")
    print(f"{len(set(before) | set(after)) - bad} equal, {bad} differ")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-programs", action="store_true",
                        help="predictions only (no lowering)")
    parser.add_argument("--compare", nargs=2, type=Path)
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*(json.loads(p.read_text()) for p in args.compare))
    found = {}
    for recipe, target in (QUICK if args.quick else CASES):
        found.update(fingerprint_case(recipe, target, not args.no_programs))
    found["planner:llama_1b_8gpu@8"] = {"table": _sha(planner_table())}
    text = json.dumps(found, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
