"""One configuration compiled for a target, and what the compiler says about it.

The step is the run's own (`framework/engine/build.py`), lowered with abstract inputs
(shapes and shardings, nothing allocated) on the target's compile-only devices
(`targets.py`) and compiled by the target's compiler: XLA:TPU in libtpu, XLA:GPU in the
CUDA plugin, or the local backend. From the compiled program:

    memory    XLA's buffer assignment per device: arguments (the train state and the
              batch), outputs, temporaries; total = arguments + outputs + temporaries
              - aliased (the donated state is counted once), on TPUs the compiler's own
              peak (`memory_check.compiled_bytes`), against the device's memory
    comm      the communication audit of the target's program (bytes per device per step
              by mesh axis, `framework/analysis/audit.py`), and on GPUs the share of those
              bytes that overlaps computation (`framework/analysis/overlap.py`'s rule)

    flops     the dots the optimized program executes per step (`gemms.matmul_flops`:
              remat's recomputation, a split backward's second pass, a MoE's padded or
              masked expert rows, attention where it is not a library kernel; each
              pipeline branch as often as the schedule runs it) over the model's FLOPs
    kernels   the kernels it launches per step by kind (`kernels.kernels_per_step`:
              GEMMs, attention, collectives, FP8 casts and absolute maxima, other), and
              the bytes they move (`traffic.py`); like the FLOPs, each pipeline branch
              as often as the schedule runs it (`hlo.Program.runs`, since 2026-12-02)

and beside them what this project predicts without compiling: the memory model's bytes
per device and the planner's step time (`framework/analysis/planner.py`), with the
model FLOPs per device per step (PaLM appendix B, no rematerialisation).
"""

from __future__ import annotations

import time

from framework.analysis.memory_check import TPU_REFUSED, compiled_bytes, hbm_oom
from framework.analysis.gemms import fp8_share, matmul_flops
from framework.analysis.kernels import kernels_per_step
from framework.analysis.traffic import accessed_by_scope, moved_bytes
from framework.compile.targets import Target, compile_devices, cudnn_of
from framework.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from framework.errors import ConfigError
from framework.parallel.pipeline.scopes import ACCUMULATE
from framework.units import gib as _size


class TooBig(ConfigError):
    """The program does not fit the target's device memory (exit status 2, one line);
    `report`: what is known of it (`fits` false)."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


def devices_for(cfg: RunConfig, target: Target) -> tuple[list, str, str]:
    """(devices, platform, device kind) the program is compiled for. `local` starts this
    process's backend as a run would; other targets need only JAX's CPU backend (never
    the accelerator plugins', which would look for hardware)."""
    import jax

    from framework.runtime import devices

    if target.platform == "local":
        devset = devices.start(cfg.devices, cfg.parallel, cfg.distributed)
        return list(devset.devices), devset.platform, devset.kind
    jax.config.update("jax_platforms", "cpu")  # no effect once a backend is started
    found = compile_devices(target)
    return found, target.platform, str(found[0].device_kind)


def predictions(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                platform: str, kind: str, n_devices: int, optim=None) -> dict:
    """The memory model's bytes (`optim`: the stored dtypes) and the planner's seconds,
    with model FLOPs per device."""
    from framework import hardware
    from framework.analysis import flops, memory_model, planner
    from framework.model.flops import model_flops_per_token

    memory = memory_model.predict_memory(model, parallel, train, platform, optim)["total"]
    out = {"memory/predicted_bytes_per_device": float(memory),
           "flops/model_per_device_per_step": model_flops_per_token(model, train.seq_len)
           * train.global_batch_size * train.seq_len / n_devices}
    peak = hardware.peak_flops(kind, model.dtype)
    if peak:
        hw = planner.Hardware(memory_bytes=1.0, peak_flops=peak, platform=platform,
                              device=kind,  # at the rates measured of such stages
                              fp8_peak_flops=hardware.peak_flops(kind, hardware.FP8))
        time = planner.predict_time(model, parallel, train, hw, optim)
        out["time/predicted_step_s"] = time["total"]
        out["time/predicted_mfu"] = time["mfu"]
        out["time/mfu_format"] = flops.matmul_format(model.fp8, model.dtype)
    return out


def compiler_options(platform: str) -> dict | None:
    """What a run on `platform` sets as XLA_FLAGS, as options of this compilation (a
    compile-only target does not read the process's XLA_FLAGS)."""
    from framework.runtime.devices import GPU_XLA_OPTIONS

    return dict(GPU_XLA_OPTIONS) if platform == "gpu" else None


def memory_fields(compiled, platform: str) -> dict:
    mem = compiled.memory_analysis()
    fields = {"memory/argument_bytes_per_device": mem.argument_size_in_bytes,
              "memory/output_bytes_per_device": mem.output_size_in_bytes,
              "memory/temp_bytes_per_device": mem.temp_size_in_bytes,
              "memory/alias_bytes_per_device": mem.alias_size_in_bytes}
    fields["memory/compiled_bytes_per_device"] = compiled_bytes(compiled, platform)
    return {k: int(v) for k, v in fields.items()}


def comm_fields(compiled, engine, platform: str) -> dict:
    from framework.analysis import audit

    mesh_shape = dict(engine.mesh.shape)
    found = audit.engine_collectives(engine, compiled.as_text())
    out = {f"comm/bytes_per_step/{a}": float(b)
           for a, b in audit.bytes_per_axis(found, mesh_shape).items()}
    if platform == "gpu":
        for axis, share in audit.overlapped_fraction(found, mesh_shape).items():
            out[f"comm/overlapped_fraction/{axis}"] = share
        for axis in ("pipe", "context"):  # the stage-to-stage sends, the ring attention's
            out[f"comm/overlapped_fraction/{axis}_sends"] = audit.sends_overlapped_fraction(
                found, axis)
        if "expert" in mesh_shape:  # (absent from dense meshes)
            out["comm/overlapped_fraction/expert_exchange"] = (
                audit.exchange_overlapped_fraction(found))
    return out


def schedule_fields(engine, parallel: ParallelConfig) -> dict:
    """The report's fields of how the step runs its microbatches: the pipeline's sends
    and table, or (one stage, several microbatches) the gradients' accumulation."""
    from framework.parallel.pipeline.autodiff import accumulates

    sched, out = engine.schedule, {}
    if accumulates(engine.program):  # one stage: m microbatches in turn, nothing sent
        out["accumulated_microbatches"] = sched.n_microbatches
    if sched.n_global_stages > 1:
        out["sends"] = "overlapped" if sched.overlap else "synchronous"
    return {**out, "combined_1f1b": parallel.combined_1f1b,  # each BW and the next F as one
            "pipeline/bubble_fraction_table": sched.bubble_fraction,
            "pipeline/backward_parts": sched.parts}


def compile_report(cfg: RunConfig, target: Target) -> dict:
    """Compiles the run's step for `target`; the report's fields (module docstring).
    Raises ConfigError (bad settings) or TooBig (the compiled program does not fit)."""
    from framework.engine.build import DocumentMask, build_engine
    from framework.engine.validate import check_platform, validate
    from framework.parallel.mesh import make_mesh, mesh_name

    found, platform, kind = devices_for(cfg, target)
    parallel = validate(cfg.model, cfg.parallel, cfg.train, len(found))
    check_platform(cfg.model, platform)
    report = {"target": target.name, "device_kind": kind, "n_devices": len(found),
              "mesh": mesh_name(parallel), "schedule": parallel.schedule,
              **predictions(cfg.model, parallel, cfg.train, platform, kind, len(found),
                            cfg.optim)}
    # data.document_mask: the program is the same whichever token ends a document
    documents = DocumentMask(0, cfg.data.reset_positions) if cfg.data.document_mask else None
    engine = build_engine(cfg.model, parallel, cfg.optim, cfg.train.steps,
                          make_mesh(parallel, found), documents)
    report.update(schedule_fields(engine, parallel), attention=engine.attention_kernel(
        cfg.train.seq_len))
    state, tokens = engine.abstract_inputs(cfg.train.global_batch_size, cfg.train.seq_len)
    start = time.perf_counter()
    try:
        with cudnn_of(target):  # cuDNN's attention compiled without the library
            compiled = engine.step_fn.lower(state, tokens).compile(
                compiler_options=compiler_options(target.platform))
    except Exception as err:  # XLA's runtime error type differs between jaxlib versions
        oom = hbm_oom(err)
        if oom is None:
            raise
        report.update({"fits": False, "memory/temp_bytes_per_device": int(oom[0]),
                       "memory/device_bytes": int(oom[1])})
        raise TooBig(_too_big(cfg, parallel, target, *oom, report, TPU_REFUSED), report) from None
    report["compile_time_s"] = time.perf_counter() - start
    report.update(memory_fields(compiled, platform))
    report["memory/device_bytes"] = target.device_bytes
    report.update(comm_fields(compiled, engine, platform))
    # per step, each of the pipeline's conditional branches as often as the schedule's
    # table runs it (`Program.scope_weights`, `hlo.Program.runs`)
    text, weights = compiled.as_text(), engine.program.scope_weights
    report.update({f"traffic/{kind}_bytes_per_step": nbytes  # copies, slices, updates
                   for kind, nbytes in moved_bytes(text, weights).items()})
    accessed = accessed_by_scope(text, weights, (ACCUMULATE,))  # what the kernels touch:
    report["traffic/accessed_bytes_per_step"] = accessed[None]  # all of them
    report["traffic/accumulated_bytes_per_step"] = accessed[ACCUMULATE]  # the gradient sums'
    report.update({f"kernels/{kind}_per_step": n  # launches by kind (analysis/kernels.py)
                   for kind, n in kernels_per_step(text, weights).items()})
    report["flops/fp8_share_of_layer_matmuls"] = fp8_share(text)
    executed = sum(matmul_flops(text, weights).values())  # every dot the program runs
    report["flops/matmul_executed_per_device_per_step"] = executed
    report["flops/matmul_executed_over_model"] = (
        executed / report["flops/model_per_device_per_step"])
    total = report["memory/compiled_bytes_per_device"]
    report["fits"] = target.device_bytes is None or total <= target.device_bytes
    if not report["fits"]:
        raise TooBig(_too_big(cfg, parallel, target, total, target.device_bytes, report),
                     report)
    return report


def _too_big(cfg: RunConfig, parallel: ParallelConfig, target: Target, needed: float,
             limit: float, report: dict, what: str = "") -> str:
    from framework.analysis.memory_check import SHOWN, Budget, suggestions

    budget = Budget(report["n_devices"], limit, target.platform, report["device_kind"])
    fits = suggestions(cfg.model, parallel, cfg.train, budget, optim=cfg.optim)
    advice = (f"predicted to fit: {'; '.join(fits[:SHOWN])}" if fits else
              "nothing on these devices is predicted to fit: use more devices or a smaller model")
    figure = what or "the compiler's figure"
    return (f"{target.name}: the compiled step needs {_size(needed)} per device ({figure}), "
            f"over the device's {_size(limit)}; {advice}")
