"""The FP8 side of tools/parity_search.py: an FP8 layout's reference is the FP8 engine
on one device with the layout's data x microbatches microbatches (FP8's scaling unit is
a data replica's microbatch: tests/parity/test_fp8.py), and with `model.fp8=delayed`
the case's params carry histories measured first, on one device, so that its step
scales by them (tests/parity/test_fp8_delayed.py)."""

from __future__ import annotations

import os


def loss_and_grads(eng, model):
    """eng's jitted (params, tokens) -> (loss, grads); FP8 under the suite's XLA level 0
    compiled at level 1 (level 0's FP8 code is off on AVX512-FP16 CPUs: docs/testing.md)."""
    fn = eng.loss_and_grads_fn()
    if model.fp8 == "none" or "optimization_level=0" not in os.environ.get("XLA_FLAGS", ""):
        return fn
    compiled = []

    def run(params, tokens):
        if not compiled:
            compiled.append(fn.lower(params, tokens).compile(
                compiler_options={"xla_backend_optimization_level": 1}))
        return compiled[0](params, tokens)
    return run


def _one_device_engine(model, par, train, optim, docs, device):
    """The engine on one device with the layout's data x microbatches microbatches (FP8's
    scaling unit is a data replica's microbatch: tests/parity/test_fp8.py)."""
    from framework.config import ParallelConfig
    from framework.engine.build import build_engine
    from framework.engine.validate import validate
    from framework.parallel.mesh import make_mesh

    one = validate(model, ParallelConfig(microbatches=par.data * par.microbatches,
                                         remat=par.remat), train, 1)
    return build_engine(model, one, optim, 1, make_mesh(one, [device]), docs)


def measured(model, par, train, optim, docs, device):
    """(canonical params, tokens) -> the params with `model.fp8=delayed`'s histories
    filled by one current-scaling pass on one device over the tokens (the step that
    fills them, without the optimizer's update): the case's step then scales by them.
    Every probe kind's post-update move applies (`probes.update`): with a MoE's
    balancing bias on, the bias moves too, for the case and its reference alike."""
    import jax

    from framework.engine import probes

    eng = _one_device_engine(model, par, train, optim, docs, device)
    fn = jax.jit(eng._loss_and_grads(probes="filling"))

    def run(params, tokens):
        placed = eng.shard_params(params)
        found = fn(placed, eng.shard_batch(tokens))[2]
        return eng.canonical_params(jax.device_get(  # on the host, as the search's
            probes.update(placed, found, eng.layout.resolved)))
    return run


def one_device(model, par, train, optim, docs, device):
    """(params, tokens) -> (loss, canonical grads) of the engine on one device with the
    layout's data x microbatches microbatches: what an FP8 layout must compute."""
    import jax

    eng = _one_device_engine(model, par, train, optim, docs, device)
    fn = loss_and_grads(eng, model)

    def run(params, tokens):
        loss, grads = fn(eng.shard_params(params), eng.shard_batch(tokens))
        return loss, eng.canonical_params(jax.device_get(grads))
    return run
