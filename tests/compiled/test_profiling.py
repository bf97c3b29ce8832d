"""The bubble timed on the devices' own timeline (framework/analysis/profiling.py): it ranks
configurations the way their schedules say, and the run's plot draws it."""

import dataclasses

import jax
import pytest

from framework.analysis import profiling
from tests.helpers import MODEL, TRAIN, engine, params, tokens

# Big enough that a cell's compute outweighs the per-tick bookkeeping on a CPU.
BIG = dataclasses.replace(MODEL, d_model=256, d_ff=512, n_layers=4)


def timed_bubble(schedule: str, pipeline: int, microbatches: int, tmp_path, **kw) -> float:
    train = dataclasses.replace(TRAIN, global_batch_size=2 * microbatches, seq_len=64)
    eng = engine(pipeline, 1, 1, microbatches, model=BIG, train=train, schedule=schedule,
                 **kw)
    box = {"state": eng.init_state(params(BIG))}
    batch = eng.shard_batch(tokens(0, train, BIG))
    eng.compile(box["state"], batch)

    def steps(n):
        for _ in range(n):
            box["state"], metrics = eng.step(box["state"], batch)
        jax.block_until_ready(metrics)

    steps(1)  # warm-up: first-run allocations stay out of the trace
    found = profiling.measure(eng, lambda: steps(3), tmp_path / f"{schedule}-{microbatches}")
    print(schedule, pipeline, microbatches, found)
    assert len(found["pipeline/bubble_fraction_timed_per_rank"]) == pipeline
    return found["pipeline/bubble_fraction_timed"]


@pytest.mark.slow
def test_no_timed_bubble_without_a_pipeline(tmp_path):
    """One stage never waits for a neighbour: no number (it read 100% before: no stage
    work is classified when there is no tick dispatch)."""
    eng = engine(1, 1, 1, 2)
    state, batch = eng.init_state(params()), eng.shard_batch(tokens(0))
    eng.compile(state, batch)

    def steps():
        jax.block_until_ready(eng.step(state, batch))

    assert profiling.measure(eng, steps, tmp_path) == {}


@pytest.mark.slow
def test_profile_classifies_the_executors_cells():
    """Structure, not names: every busy branch of the cell dispatch is stage work of its
    kind, in both executors."""
    for sched, kinds in [("gpipe", {"F", "BW"}), ("zb_h1", {"F", "B", "W"})]:
        eng = engine(2, 1, 1, 4, schedule=sched)
        state, toks = eng.abstract_inputs(TRAIN.global_batch_size, TRAIN.seq_len)
        hlo = eng.step_fn.lower(state, toks).compile().as_text()
        module, work, loops = profiling.classify(hlo, eng.schedule)
        assert module and set(work.values()) == kinds, (sched, set(work.values()))
        assert set(work) <= set(loops)  # all work is inside the tick loops
        assert set(loops.values()) == ({"forward", "backward"} if sched == "gpipe" else {"ticks"})


def test_profile_window_fits_the_run():
    assert profiling.profile_steps(2, 3, 0, 100) == (3, 4)
    assert profiling.profile_steps(2, 50, 0, 20) == (19, 20)  # moved into the run
    assert profiling.profile_steps(2, 3, 10, 100) == (12, 13)  # resumed at step 10
    assert profiling.profile_steps(2, 3, 0, 2) is None  # too short: its 1st step is warm-up
    assert profiling.profile_steps(0, 3, 0, 100) is None
