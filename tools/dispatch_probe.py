"""Does this jaxlib's compiler keep what a conditional passes through in place?

    python tools/dispatch_probe.py aot     # the GPU compiler, deviceless (gpu:h100x8)
    python tools/dispatch_probe.py cpu     # the CPU compiler, 8 simulated devices

Compiles the tick executor both ways, passing through (`StageFns.pass_through`) and with
the cells' writes apart (`ticks.Cells.apart`), and prints per program the compiled
memory per device and the bytes of carried buffers copied in the tick loop each step
(`profiling.carried_copies`). Where passing through copies
nothing and holds less, `engine.step.passes_through` should say so for that compiler
(`GPU_PASS_THROUGH_SINCE`). With `aot` it also compiles `llama_1b_8gpu`'s 1F1B step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY = ["parallel.pipeline=4", "parallel.data=2", "parallel.tensor=1",
        "parallel.microbatches=4"]


def _devices(platform: str):
    from framework.config import DevicesConfig, ParallelConfig
    from framework.runtime import devices
    from framework.runtime.devices import DeviceSet

    if platform == "cpu":
        devset = devices.start(DevicesConfig(platform, 8), ParallelConfig())
        return devset, devset.devices
    import jax

    from framework.compile import targets

    jax.config.update("jax_platforms", "cpu")  # compiling only: no GPU backend here
    found = targets.compile_devices(targets.parse("gpu:h100x8"))
    return DeviceSet(tuple(found), "gpu", False, found[0].device_kind, 0, 1), found


def _one(recipe: str, extra: list[str], through: bool, devset, found) -> str:
    from framework.analysis import memory_check
    from framework.analysis.profiling import carried_copies
    from framework.engine.build import build_engine
    from framework.engine.validate import validate
    from framework.parallel.mesh import make_mesh
    from tools.parity_search import gpu_dispatch
    from tools.recipe import compose

    cfg = compose([f"recipe={recipe}", *extra])
    par = validate(cfg.model, cfg.parallel, cfg.train, len(found))
    start = time.perf_counter()
    with gpu_dispatch(apart=not through):
        eng = build_engine(cfg.model, par, cfg.optim, cfg.train.steps, make_mesh(par, found))
        eng.compile(*eng.abstract_inputs(cfg.train.global_batch_size, cfg.train.seq_len))
    total = memory_check.compiled_bytes(eng.compiled, devset.platform)
    copied, carry = carried_copies(eng.compiled.as_text(), share=0.1)
    return (f"{recipe} {' '.join(extra)} pass_through={through}: compiled "
            f"{total / 2**30:.3f} GiB, carried copies {copied / 1e9:.3f} GB a step "
            f"(carry {carry / 1e9:.3f} GB), compile {time.perf_counter() - start:.1f} s")


def main(argv: list[str]) -> int:
    platform = argv[0] if argv else "aot"
    if platform not in ("aot", "cpu"):
        print(f"error: {platform!r}: aot (the GPU compiler, deviceless) or cpu",
              file=sys.stderr)
        return 2
    import jax
    import jaxlib

    devset, found = _devices(platform)
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}: {len(found)} x "
          f"{found[0].device_kind}", flush=True)
    runs = [("llama_tiny_debug", TINY + [f"parallel.schedule={s}"]) for s in ("1f1b", "zb_h1")]
    if platform != "cpu":
        runs.append(("llama_1b_8gpu", ["parallel.schedule=1f1b"]))
    for recipe, extra in runs:
        for through in (True, False):
            print(_one(recipe, extra, through, devset, found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
