"""A randomized search for layouts that compute something else than one device does.

    python tools/parity_search.py --cases 200 --seed 1     # a developer's long sweep
    python tools/parity_search.py --cases 40 --schedules zb_h1,zb_v --fp8-share 0

Draws random valid configurations (schedule from the registry, pipeline, data, context,
tensor, microbatches, virtual stages, uneven stages (a third), overlapped or synchronous
sends, sequence parallelism and collective matmuls, ZeRO-1, FSDP (half of it gathering
once a step, from a stream of its own), remat, tied embeddings, the dense or blockwise
kernel and its block sizes, document masks (a third; token 0 then ends documents, an
eighth of the tokens are 0), the model family (its presets: q/k/v biases, q/k norms,
Gemma 2's layer; the mixtures of experts with their experts, top-k, widths, auxiliary
losses, router (softmax or sigmoid, scaled or not; sigmoid with 4 or 8 experts routed to
the best of 2 groups) and shared experts (in half, gated or not, with a dense layer
before the MoE ones) drawn), sliding windows (a third; every layer or every other),
soft-caps, the loss over the vocabulary in chunks of tokens (a third, from a stream of
its own: `model.loss_chunk`), `save_dots_gathered` for half the `save_dots` (likewise),
the stored parameter dtype (bfloat16 in a quarter), FP8 matmuls (a quarter, from a
stream of their own; against the FP8 engine on one device, FP8_GRAD_TOLERANCE), small
shapes; for the tick executor's schedules, half with the dispatch of GPU compilers that
copy what a conditional passes through, forced on CPU: `gpu-dispatch`), runs each one's
loss and gradients twice on the same inputs, and compares the loss and every gradient
leaf of both runs with the single-device reference (framework/model/reference.py):
relative error at most 1e-4 (bfloat16 parameters: 2^-5, their gradients rounded per
microbatch rather than once). A failure is printed as one line of
`python -m framework.run` settings, e.g.

    FAIL zb_h1 pp4 dp1 tp2 mb8: 19.6 (run 2) ... | parallel.pipeline=4 parallel.data=1 ...

tests/parity/test_search.py runs a fixed seed of this in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from framework.runtime.quiet import import_jax  # noqa: E402

import_jax()  # before anything imports JAX: its plugins' start-up lines stay off stderr

from tools import parity_fp8  # noqa: E402

TOLERANCE = 1e-4
BF16_TOLERANCE = 2.0 ** -5  # a few bfloat16 roundings of a microbatch's gradient sum
# FP8's gradients against the FP8 engine on one device: one E5M2 step (a float32
# rounding upstream moves an E5M2 rounding by a step, and the layers below carry it:
# docs/testing.md); the loss at TOLERANCE
FP8_GRAD_TOLERANCE = 0.25


def draw(rng: np.random.Generator, n_devices: int = 8, names: tuple = ()):
    """(model, parallel, train, data, param_dtype) of one valid random configuration on
    at most n_devices (data: its document masks); `names`: the schedules drawn from
    (default: every registered one)."""
    from framework.config import CHOICES, DataConfig, ModelConfig, ParallelConfig, TrainConfig
    from framework.engine.validate import check, combined_where_possible
    from framework.model.moe import MOE_FAMILIES
    from framework.parallel.pipeline import schedule as schedules

    pick = lambda options: options[int(rng.integers(len(options)))]
    while True:
        name = pick(list(names or schedules.schedule_names()))
        p, t = pick([1, 2, 4]), pick([1, 2, 4])
        c = pick([c for c in (1, 1, 2, 4) if p * c * t <= n_devices] or [1])  # context
        d = pick([d for d in (1, 2, 4) if p * d * c * t <= n_devices] or [1])
        v = pick([1, 2]) if schedules.uses_virtual_stages(name) else 1
        m = pick([1, 2, 4, 8])
        kv = pick([k for k in (1, 2, 4) if k % t == 0] or [t])
        heads = kv * pick([1, 2])
        windowed = rng.integers(3) == 0
        stages = p * schedules.chunks_per_rank(name, v)
        uneven = stages > 1 and rng.integers(3) == 0  # random layers per stage, each >= 1
        # (3 layers a stage: synchronous 1F1B cuts its BWs in 3 parts under full remat)
        n_layers = int(rng.integers(stages, 2 * stages + 2)) if uneven else stages * pick([1, 2, 3])
        stage_layers = tuple(int(n) + 1 for n in rng.multinomial(
            n_layers - stages, [1 / stages] * stages)) if uneven else None
        model = ModelConfig(
            vocab_size=32 * pick([2, 4]), d_model=heads * pick([8, 16]),
            n_layers=n_layers, n_heads=heads,
            n_kv_heads=kv,
            d_ff=16 * pick([2, 3, 4]), tie_embeddings=bool(rng.integers(2)),
            attention=pick(["dense", "blockwise"]), attention_block_q=pick([2, 4, 512]),
            attention_block_kv=pick([2, 4, 512]), dtype="float32",
            family=pick(list(CHOICES["model.family"])),
            sliding_window=int(rng.integers(2, 8)) if windowed else None,
            sliding_window_pattern=pick([0, 2]) if windowed else 0,
            attn_softcap=pick([None, 20.0]), final_softcap=pick([None, 30.0]))
        if model.family in MOE_FAMILIES:  # (drawn only then: other cases keep their draw)
            model = _moe(pick, rng, model, c)
        sp = bool(rng.integers(2)) and t > 1
        par = ParallelConfig(pipeline=p, data=d, tensor=t, context=c, microbatches=m,
                             schedule=name,
                             virtual_stages=v, remat=pick(["none", "full", "save_dots"]),
                             zero1=bool(rng.integers(2)) and d > 1,
                             fsdp=bool(rng.integers(2)) and d > 1, sequence_parallel=sp,
                             collective_matmul=sp and bool(rng.integers(2)),
                             stage_layers=stage_layers, overlap_sends=bool(rng.integers(2)),
                             expert=_expert(pick, model, d))
        if par.expert > 1 and model.moe.capacity_factor is not None:  # (drawn only then)
            par = dataclasses.replace(par, expert_chunks=pick([1, 2]))
        if rng.integers(2) and par.pipeline > 1:  # (half the tables that can run combined)
            par = combined_where_possible(dataclasses.replace(par, combined_1f1b=True))
        train = TrainConfig(seq_len=pick([8, 16]), global_batch_size=d * m * pick([1, 2]),
                            seed=int(rng.integers(1000)))
        masked = rng.integers(3) == 0
        data = DataConfig(document_mask=bool(masked),
                          reset_positions=bool(masked and rng.integers(2)))
        param_dtype = "bfloat16" if rng.integers(4) == 0 else "float32"
        if par.n_devices <= n_devices and not check(model, par, train, par.n_devices):
            return model, par, train, data, param_dtype


def _moe(pick, rng, model, context: int):
    """The mixture-of-experts settings of a MoE family's drawn model (a capacity factor
    only without context parallelism, which refuses it)."""
    from framework.config import MoeConfig

    experts = pick([2, 4, 8])
    model = dataclasses.replace(model, moe=MoeConfig(
        experts=experts, top_k=pick([k for k in (1, 2) if k <= experts]),
        expert_hidden=pick([None, 16]), renormalize=bool(rng.integers(2)),
        aux_loss_coef=pick([0.0, 0.1]), z_loss_coef=pick([0.0, 0.01]),
        capacity_factor=pick([None, 0.75, 1.5]) if context == 1 else None))
    shared = pick([0, 0, 1, 2])  # shared experts in one case of two, gated or not
    model = dataclasses.replace(model, moe=dataclasses.replace(
        model.moe, router=pick(["softmax", "sigmoid"]), routed_scale=pick([1.0, 2.5]),
        shared_experts=shared, shared_hidden=pick([None, 16]) if shared else None,
        shared_gate=bool(shared and rng.integers(2))))
    # sigmoid-routed with 4 or 8 experts: DeepSeek-V3's group-limited routing, the best
    # of 2 groups (no draw of its own: the draws after it stay as they were)
    groups = 2 if model.moe.router == "sigmoid" and experts >= 4 else 1
    # with shared experts, as DeepSeek-V3, a dense layer first (framework/model/prefix.py):
    # one layer more, so the stages' layers are as drawn
    first = 1 if shared else 0
    # without shared experts and with a routed scale, MoE every 2nd layer (Qwen's
    # decoder_sparse_step 2; a unit of a dense layer and a MoE one): twice the layers, so
    # that the stages' units are as drawn (no draw of its own, as above)
    every = 2 if not shared and model.moe.routed_scale != 1.0 and \
        not model.sliding_window_pattern else 1
    return dataclasses.replace(model, n_layers=first + every * model.n_layers,
                               moe=dataclasses.replace(model.moe, expert_groups=groups,
                                                       top_groups=1, first_dense=first,
                                                       every=every))


def _expert(pick, model, d: int) -> int:
    """`parallel.expert` for a mixture of experts (drawn only then): a degree dividing
    the data replicas and the experts."""
    if not model.moe.enabled:
        return 1
    return pick([e for e in (1, 2, 4) if d % e == 0 and model.moe.experts % e == 0])


def overrides(model, par, train, data=None, param_dtype="float32") -> str:
    """The configuration as `python -m framework.run` settings (one line)."""
    items = [("model", model), ("parallel", par), ("train", train)]
    out = []
    for group, cfg in items + ([("data", data)] if data is not None else []):
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if f.name == "moe":  # a nested group: its own dotted settings
                out += [f"model.moe.{k}={_setting(v)}" for k, v in vars(value).items()]
                continue
            if f.name in ("rope_scaling", "resume", "resume_from", "stop_at", "init_from",
                          "steps", "tensor_split") or (
                    group == "data" and f.name not in ("document_mask", "reset_positions")):
                continue
            value = str(value).lower() if isinstance(value, bool) else value
            if isinstance(value, tuple):  # Hydra's list syntax
                value = "[" + ",".join(map(str, value)) + "]"
            out.append(f"{group}.{f.name}={'null' if value is None else value}")
    return " ".join(out + [f"optim.param_dtype={param_dtype}"])


def _setting(value) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _relative_errors(grads, ref) -> list[float]:
    """Per leaf: max |a - b| over max |b|, or over 1e-4 of the largest gradient where
    the leaf's is below it: a gradient zero but for rounding (MoE's router with top_k 1
    renormalised and no auxiliary loss: its weight is 1 whatever the logits; 4e-10 of
    the largest gradient apart, seed 102 case 2) is compared as the zero it is, not as
    noise against noise. A leaf wrong by its own size is still found down to 1e-8 of
    the largest."""
    import jax

    floor = 1e-4 * max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(ref))

    def one(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor, 1e-30))

    return jax.tree.leaves(jax.tree.map(one, grads, ref))


def run_case(model, par, train, devices, data=None, param_dtype="float32",
             apart: bool = False) -> str | None:
    """None when both runs match the reference, else why not (one line). `apart`: the
    tick executor's dispatch for compilers that copy what a conditional passes through
    (`ticks.Cells.apart`, GPUs before jaxlib 0.11.2), forced on CPU."""
    import jax
    import jax.numpy as jnp

    from framework.config import OptimConfig
    from framework.engine.build import build_engine
    from framework.model import reference
    from framework.model.documents import DocumentMask
    from framework.model.llama import init_params
    from framework.parallel.mesh import make_mesh

    from framework.engine.state import as_dtype

    # on the host: the engines' relayouts of host arrays are numpy indexing, not small
    # XLA programs compiled per leaf shape (~15% of a case's time)
    params = jax.device_get(jax.jit(lambda k: as_dtype(init_params(model, k), param_dtype))(
        jax.random.key(train.seed)))
    tokens = reference.tokens_for_step(train.seed, 0, train.global_batch_size,
                                       train.seq_len, model.vocab_size)
    docs = None
    if data is not None and data.document_mask:  # token 0 ends documents, 1 in 8 tokens
        docs = DocumentMask(0, data.reset_positions)
        tokens = jnp.where(tokens < model.vocab_size // 8, 0, tokens)
    # (a mixture of experts' auxiliary losses: statistics of each replica's microbatch)
    ref_loss, ref_grads = jax.jit(lambda p, x: reference.loss_and_grads(
        p, x, model, documents=docs, groups=par.data * par.microbatches))(params, tokens)
    optim = OptimConfig(param_dtype=param_dtype)
    if model.fp8 == "delayed":  # scales from histories: measured first, on one device
        params = parity_fp8.measured(model, par, train, optim, docs, devices[0])(params, tokens)
    if model.fp8 != "none":  # FP8's reference: the engine on one device (below)
        ref_loss, ref_grads = parity_fp8.one_device(model, par, train, optim, docs, devices[0])(
            params, tokens)
    eng = build_engine(model, par, optim, 1, make_mesh(par, devices), docs)
    tolerance = TOLERANCE if param_dtype == "float32" else BF16_TOLERANCE
    grad_tolerance = FP8_GRAD_TOLERANCE if model.fp8 != "none" else tolerance
    with gpu_dispatch(apart):
        fn = parity_fp8.loss_and_grads(eng, model)
    args = eng.shard_params(params), eng.shard_batch(tokens)
    for attempt in (1, 2):
        loss, grads = fn(*args)
        loss_err = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
        worst = max(_relative_errors(eng.canonical_params(jax.device_get(grads)), ref_grads))
        if loss_err > tolerance or worst > grad_tolerance:
            return (f"run {attempt}: loss {float(loss):.6g} (reference "
                    f"{float(ref_loss):.6g}), worst gradient leaf off by {worst:.3g}")
    return None


@contextlib.contextmanager
def gpu_dispatch(apart: bool = True):
    """With `apart`, a step built inside reads `passes_through` as a GPU's of jaxlib
    0.10.2 would (`engine.step.passes_through`, read when the step is built); without,
    as CPUs and TPUs do."""
    from framework.engine import step

    kept = step.passes_through
    step.passes_through = lambda platform: not apart
    try:
        yield
    finally:
        step.passes_through = kept


def label(par, data=None, model=None, param_dtype="float32", apart=False) -> str:
    extra = "".join(f" {k}" for k in ("zero1", "fsdp", "sequence_parallel",
                                      "collective_matmul") if getattr(par, k))
    if model is not None:
        extra += "" if model.family == "llama" else f" {model.family}"
        extra += f" window{model.sliding_window}" if model.sliding_window else ""
        extra += " softcap" if model.attn_softcap or model.final_softcap else ""
        m = model.moe
        extra += f" moe{m.experts}x{m.top_k}" if m.enabled else ""
        extra += f" capacity{m.capacity_factor}" if m.capacity_factor is not None else ""
        extra += f" {m.router}" if m.enabled and m.router != "softmax" else ""
        extra += f" groups{m.top_groups}of{m.expert_groups}" if m.enabled and \
            m.expert_groups > 1 else ""
        extra += f" shared{m.shared_experts}" if m.enabled and m.shared_experts else ""
        extra += f" dense{m.first_dense}" if m.enabled and m.first_dense else ""
        extra += f" every{m.every}" if m.enabled and m.every > 1 else ""
    extra += f" loss-chunk{model.loss_chunk}" if model is not None and model.loss_chunk else ""
    extra += " bf16-params" if param_dtype != "float32" else ""
    extra += {"none": "", "tensorwise": " fp8", "delayed": " fp8-delayed"}[
        model.fp8 if model is not None else "none"]
    extra += " document_mask" if data is not None and data.document_mask else ""
    extra += "" if par.overlap_sends else " synchronous"
    extra += " combined" if par.combined_1f1b else ""
    extra += " regather-step" if par.fsdp and par.fsdp_regather == "step" else ""
    extra += " gpu-dispatch" if apart else ""
    v = f" v{par.virtual_stages}" if par.virtual_stages > 1 else ""
    cp = f" cp{par.context}" if par.context > 1 else ""
    cp += f" ep{par.expert}" if par.expert > 1 else ""
    return (f"{par.schedule} pp{par.pipeline} dp{par.data}{cp} tp{par.tensor} "
            f"mb{par.microbatches}{v} remat={par.remat}{extra}")


def _with_fp8(model, par, train, rng):
    """The drawn model with FP8 matmuls where the validation lets them run with the
    drawn case (a MoE's experts: capacity slots; split over `expert` devices, delayed
    scaling only): `delayed` in half the cases where both modes run, else the one that
    does; the model as drawn where none does."""
    from framework.engine.validate import check

    def runs(mode):
        return not check(dataclasses.replace(model, fp8=mode), par, train, par.n_devices)

    modes = [m for m in ("tensorwise", "delayed") if runs(m)]
    if not modes:
        return model
    mode = modes[0] if len(modes) == 1 else modes[int(rng.integers(2))]
    return dataclasses.replace(model, fp8=mode, fp8_history=3 if mode == "delayed" else
                               model.fp8_history)


def search(seed: int, cases: int, devices, log=print, names: tuple = (),
           fp8_share: float = 0.25) -> list[str]:
    """Draws `cases` configurations; returns one line per failure. `fp8_share`: the
    share of them with FP8 matmuls (`model.fp8=tensorwise`, or `delayed` in half of
    them)."""
    import warnings

    from framework.engine.resolved import resolved

    rng = np.random.default_rng(seed)
    # the executor's dispatch from a stream of its own: a seed draws the configurations
    # it drew before the dispatch was drawn
    dispatch_rng = np.random.default_rng([seed, 1])
    fp8_rng, regather_rng, delayed_rng, chunk_rng, gathered_rng = (
        np.random.default_rng([seed, k]) for k in (2, 3, 4, 5, 6))  # (likewise)
    failures = []
    for i in range(cases):
        model, par, train, data, param_dtype = draw(rng, len(devices), names)
        if fp8_rng.random() < fp8_share:
            model = _with_fp8(model, par, train, delayed_rng)
        if chunk_rng.integers(3) == 0:  # the loss a chunk of tokens at a time
            model = dataclasses.replace(model, loss_chunk=int(chunk_rng.choice([8, 24, 64])))
        if par.remat == "save_dots" and gathered_rng.integers(2):  # (f's gathers kept)
            par = dataclasses.replace(par, remat="save_dots_gathered")
        if par.fsdp and regather_rng.integers(2):
            par = dataclasses.replace(par, fsdp_regather="step")
        apart = bool(dispatch_rng.integers(2)) and not resolved(model, par,
                                                                  train.seq_len).program.autodiff
        start = time.perf_counter()
        with warnings.catch_warnings():  # microbatches < pipeline: drawn on purpose
            warnings.simplefilter("ignore")
            try:
                why = run_case(model, par, train, devices[:par.n_devices], data, param_dtype,
                               apart)
            except Exception as err:  # a layout that does not even build is a finding too
                why = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
        name = label(par, data, model, param_dtype, apart)
        line = f"{name}: {why} | {overrides(model, par, train, data, param_dtype)}" if why else None
        if line:
            failures.append(line)
        log(f"[{i + 1}/{cases}] {'FAIL ' + line if line else 'ok   ' + name} "
            f"({time.perf_counter() - start:.1f} s)")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--fp8-share", type=float, default=0.25, help="model.fp8's share")
    parser.add_argument("--schedules", default="", help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    from framework.errors import ConfigError
    from framework.parallel.pipeline import schedule as schedules

    names = tuple(filter(None, args.schedules.split(",")))
    unknown = sorted(set(names) - set(schedules.schedule_names()))
    if unknown:
        print(ConfigError(f"--schedules: {', '.join(unknown)} not one of "
                          f"{', '.join(schedules.schedule_names())}"), file=sys.stderr)
        return 2
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.config.update("jax_platforms", "cpu")
    failures = search(args.seed, args.cases, jax.devices(), names=names, fp8_share=args.fp8_share)
    print(f"{len(failures)} of {args.cases} configurations differ from the reference")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
