"""What hangs off the training loop (`framework/run/loop.py`): the batches it feeds,
and the side effects it runs every so many steps. Each maker takes only the settings
it uses and returns a plain function.

    make_batches     step -> the step's global batch on the mesh (framework/io/data.py)
    make_evaluator   eval/loss: forward-only loss on held-out batches (eval.every)
    make_sampler     eval/sample: a greedy continuation of eval.sample_prompt
    save_checkpoint  an asynchronous checkpoint, once the records of its steps are
                     durable (checkpoint.every, and the last one of every run)
    profile_window   the steps traced to time the pipeline bubble (profile.*)
"""

from __future__ import annotations

import jax
import numpy as np

from framework.analysis import profiling
from framework.config import EvalConfig, ModelConfig, ProfileConfig
from framework.errors import ConfigError, Diverged, NonFiniteStateError, StorageError
from framework.io.checkpoint.manager import Checkpointer
from framework.io.data import sharded_batch
from framework.run.loop import ProfileWindow, to_host
from framework.run.tracking import Tracker
from framework.runtime import distributed


def make_batches(dataset, engine, fetch=None):
    """step -> this process's rows of the step's batch, placed on the mesh as one
    global [global_batch, seq_len + 1] array (framework/io/data.py)."""
    sharding = engine.batch_sharding()
    fetch = fetch or dataset.train_batch
    return lambda step: sharded_batch(fetch, step, sharding, dataset.global_shape)


def make_evaluator(engine, dataset, n_batches: int, name: str | None = None):
    """(step, state) -> {"eval/loss" (a named set: "eval/<name>/loss"): mean
    forward-only loss over the first `n_batches` held-out batches} (the same batches at
    every evaluation)."""
    key = "eval/loss" if name is None else f"eval/{name}/loss"
    loss_fn = engine.eval_loss_fn()
    held_out = make_batches(dataset, engine, dataset.eval_batch)
    batches = [held_out(i) for i in range(n_batches)]

    def evaluate(step, state) -> dict:
        losses = [loss_fn(state["params"], tokens) for tokens in batches]
        return {key: float(np.mean([to_host(x) for x in losses]))}

    return evaluate


def make_sampler(model: ModelConfig, evaluation: EvalConfig, engine, codec, primary: bool):
    """(step, state) -> {"eval/sample": the greedy continuation of eval.sample_prompt}
    (framework/engine/decode.py on the training mesh; the parameters are gathered over
    `pipe` for the sample, tensor-sharded as in training)."""
    from framework.engine.decode import Decoder

    decoder = Decoder(model, engine.mesh)
    to_decoder = jax.jit(engine.canonical_params, out_shardings=decoder.param_shardings)
    prompt = codec.encode(evaluation.sample_prompt)
    if not prompt or max(prompt) >= model.vocab_size:
        raise ConfigError(f"eval.sample_prompt={evaluation.sample_prompt!r} encodes to "
                          f"{prompt[:8]}: need 1+ ids below model.vocab_size="
                          f"{model.vocab_size}")

    def sample(step, state) -> dict:
        ids = decoder.generate(to_decoder(state["params"]), [prompt], evaluation.sample_tokens)
        text = codec.decode(ids[0].tolist())
        if primary:
            print(f"sample at step {step}: {evaluation.sample_prompt!r} -> {text!r}",
                  flush=True)
        return {"eval/sample": text}

    return sample


def save_checkpoint(ckpt: Checkpointer, engine, state, step: int, meta: dict,
                    tracker: Tracker | None = None) -> None:
    """Starts an asynchronous save of `state` as step `step` (no-op if saved already),
    once the records of its steps are durable. Raises StorageError if a save failed
    (checked on every process together), Diverged for a non-finite state."""
    failure = distributed.first_error(ckpt.failed_save())
    if failure:
        raise StorageError(failure)
    if tracker is not None:
        tracker.sync()
    warning = ckpt.low_space_warning()
    if warning and not ckpt.warned and distributed.is_primary():
        print(warning, flush=True)
        ckpt.warned = True
    try:
        ckpt.save(step, engine.layout, state, meta)
    except NonFiniteStateError as err:
        raise Diverged(step, str(err)) from None


def profile_window(profile: ProfileConfig, last: int, engine, start: int,
                   tracker: Tracker) -> ProfileWindow | None:
    """The steps traced to time the pipeline bubble (framework/analysis/profiling.py)
    before step `last`; their per-rank bubble goes to summary.json."""
    window = profiling.profile_steps(profile.steps, profile.start_step, start, last)
    if window is None:
        return None
    profiler = profiling.Profiler(engine, tracker.run_dir, profile.keep_trace_mb)

    def stop() -> dict:
        found = profiler.stop()
        tracker.summary.update(found)
        return found

    return ProfileWindow(window[0], window[1], profiler.start, stop)
