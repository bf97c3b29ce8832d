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
