"""Every collective of a compiled train step, and the bytes per mesh axis against what
the math requires.

    python tools/comm_audit.py recipe=llama_small_3d
    python tools/comm_audit.py recipe=llama_small_3d parallel.sequence_parallel=true
    python tools/comm_audit.py recipe=llama_tiny_debug parallel.schedule=1f1b --hlo step.hlo

Compiles (does not run) the step for the composed configuration on simulated CPU
devices (or the accelerators, with devices.platform=gpu|tpu) and prints one row per
collective: kind, the mesh axes its replica groups span, executions per step, buffer
and bytes sent per device per step (`framework/analysis/audit.py`), then per axis the measured
total beside `framework/analysis/comm_model.py`'s analytic expectation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from framework.runtime.quiet import import_jax  # noqa: E402

import_jax()  # before anything imports JAX: its plugins' start-up lines stay off stderr

from recipe import compose, user_error  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="recipe=<name> and key=value overrides")
    parser.add_argument("--hlo", type=Path, help="also write the compiled HLO text here")
    args = parser.parse_args(argv)

    from framework.runtime import devices
    from framework.errors import ConfigError
    from framework.engine.validate import validate
    try:
        cfg = compose(args.overrides)
        devset = devices.start(cfg.devices, cfg.parallel)
        parallel = validate(cfg.model, cfg.parallel, cfg.train, len(devset))
    except ConfigError as err:
        return user_error(err)

    from framework.analysis import audit, comm_model
    from framework.engine.build import build_engine
    from framework.parallel.mesh import make_mesh
    from framework.parallel.mesh import mesh_name

    engine = build_engine(cfg.model, parallel, cfg.optim, cfg.train.steps,
                          make_mesh(parallel, devset.devices))
    state, tokens = engine.abstract_inputs(cfg.train.global_batch_size, cfg.train.seq_len)
    hlo = engine.step_fn.lower(state, tokens).compile().as_text()
    if args.hlo:
        args.hlo.write_text(hlo)
    found = audit.engine_collectives(engine, hlo)
    mesh_shape = dict(engine.mesh.shape)
    measured = audit.bytes_per_axis(found, mesh_shape)
    expected = comm_model.expected_bytes(cfg.model, parallel, cfg.train,
                                         param_dtype=cfg.optim.param_dtype)
    print(f"{mesh_name(parallel)} ({parallel.schedule}"
          f"{', sequence parallel' if parallel.sequence_parallel else ''}"
          f"{', ZeRO-1' if parallel.zero1 else ''}): {len(found)} collectives; "
          f"bytes sent per device per step")
    print(audit.report(found))
    print(f"\n{'axis':<8}{'measured':>16}{'expected':>16}{'ratio':>8}")
    for axis in mesh_shape:
        ratio = f"{measured[axis] / expected[axis]:.3f}" if expected[axis] else "-"
        print(f"{axis:<8}{measured[axis]:>16,.0f}{expected[axis]:>16,.0f}{ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
