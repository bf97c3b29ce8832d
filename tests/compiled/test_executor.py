"""The tick executor's compiled loop (framework/parallel/pipeline/ticks.py) writes its
buffers in place: no buffer the loop carries (gradient accumulators, stash, saved
buffers, receive slots) is copied inside a tick. Dispatching the cells with one
`lax.switch` copied the gradient accumulators in every branch that left them alone and
again after it (1.3 to 2.9 MB a step of this program, every schedule and send mode);
a stash write under a conditional after a read in the other tick of a pair copied the
whole stash (found and fixed 2026-11-27)."""

import importlib.util

import pytest

from framework.analysis.profiling import carried_copies
from tests.helpers import compose_recipe, engine, params, tokens

HAVE_AOT = all(importlib.util.find_spec(m) for m in ("libtpu", "jax_plugins"))


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1),
                                        ("zb_v", 1)])
def test_the_tick_loop_copies_no_buffer_it_carries(schedule, v, overlap):
    eng = engine(4, 1, 1, 8, schedule=schedule, virtual_stages=v, overlap_sends=overlap)
    state = eng.init_state(params())
    text = eng.step_fn.lower(state, eng.shard_batch(tokens(0))).compile().as_text()
    copied, carry = carried_copies(text)
    assert carry > 0
    assert copied == 0, f"{copied} bytes of carried buffers copied a step (carry {carry})"


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_AOT, reason="needs the CUDA plugin (the aot extra)")
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_on_the_gpu_compiler_the_stash_and_chunk_gradients_are_not_copied(schedule):
    """The GPU compiler before jaxlib 0.11.2 copies what a conditional passes through, so there
    the cells hand their weight gradients and what they keep to in-place writes after
    their conditionals (`Cells.apart`). The stash and the chunks' gradient
    accumulators (each a tenth of the carry or more here) are never copied; before,
    8.4 GB of them a step were at the 1B recipe (the embedding's gradient still is, in
    the head's and its own conditional: 1.5 GB there)."""
    from framework.analysis import memory_check
    from framework.compile import targets
    from framework.engine.build import build_engine
    from framework.engine.validate import validate
    from framework.parallel.mesh import make_mesh
    from framework.runtime.devices import DeviceSet

    cfg = compose_recipe("llama_tiny_debug", "parallel.pipeline=4", "parallel.data=2",
                         "parallel.tensor=1", "parallel.microbatches=4",
                         f"parallel.schedule={schedule}", "devices.memory_limit_gb=80")
    found = targets.compile_devices(targets.parse("gpu:h100x8"))
    devset = DeviceSet(tuple(found), "gpu", False, found[0].device_kind, 0, 1)
    parallel = validate(cfg.model, cfg.parallel, cfg.train, len(found))
    eng = build_engine(cfg.model, parallel, cfg.optim, cfg.train.steps,
                       make_mesh(parallel, found))
    memory_check.check_compiled(cfg, eng, devset)
    copied, carry = carried_copies(eng.compiled.as_text(), share=0.1)
    assert copied == 0, f"{copied} bytes of carried buffers copied a step (carry {carry})"


@pytest.mark.parametrize("apart", [False, True], ids=["pass_through", "apart"])
@pytest.mark.parametrize("schedule,v,overlap", [("1f1b", 1, True), ("1f1b", 1, False),
                                                ("zb_h1", 1, True), ("zb_h1", 1, False),
                                                ("interleaved_1f1b", 2, True)])
def test_the_lowered_dispatch_opens_the_programs_branches(schedule, v, overlap, apart,
                                                          monkeypatch):
    """The conditionals the lowered tick loop opens, by their named scopes, are the
    branches of its Program (`Program.branches`), whose scopes the audit's weights are
    computed from: every scope it opens has a weight, and every weight a scope. (Lowered,
    not compiled: a few seconds each.)"""
    import re

    from framework.engine import step

    monkeypatch.setattr(step, "passes_through", lambda platform: not apart)
    eng = engine(4, 1, 1, 8, schedule=schedule, virtual_stages=v, overlap_sends=overlap)
    state = eng.init_state(params())
    text = eng.step_fn.lower(state, eng.shard_batch(tokens(0))).as_text(debug_info=True)
    opened = set(re.findall(r'"cell/(cell_\w+(?:/on_\w+_stage)?)/cond', text))
    prog, k = eng.program, eng.program.schedule.ticks_per_step
    branches = {"/".join(b.scopes) for phase in range(k) for b in prog.branches(phase)}
    assert opened == branches
    weighted = {name for name in prog.scope_weights if not name.startswith("send_")}
    assert weighted == {scope.split("/")[-1] for scope in opened}
