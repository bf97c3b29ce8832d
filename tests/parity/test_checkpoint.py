"""Checkpoints: exact resume, restore under other (pipeline, data, tensor, schedule,
zero1, fsdp) layouts, keep/metadata, and incomplete checkpoints never picked.

One (2, 2, 2) engine trains 10 steps on the Markov dataset uninterrupted; a second run
of the same engine saves at steps 2, 4, 6 (asynchronously, keep=2) and keeps training.
Everything else restores step 6 into fresh engines and continues to step 10.
"""

import functools
import os
import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from framework.config import DataConfig, TrainConfig
from framework.errors import ConfigError, DamagedCheckpoint, NonFiniteStateError
from framework.io import data
from framework.io.checkpoint import manager as checkpoint
from framework.io.checkpoint import paths
from framework.io.checkpoint.manager import Checkpointer
from framework.run import start
from tests.helpers import canonical_of, MODEL, TRAIN, engine, host, max_rel_err, params, worst

pytestmark = pytest.mark.slow  # every test shares two 10-step training runs

LAYOUT = (2, 2, 2, 2)  # (pipeline, data, tensor, microbatches) of the saving run
SAVE_AT, STEPS = 6, 10
DATASET = data.make_dataset(DataConfig(kind="markov"), TRAIN, MODEL.vocab_size)


def run(eng, state, start, stop, ckpt=None, save_at=()):
    """Steps start..stop-1 on the dataset's batches; saves after the steps in save_at."""
    losses = []
    for step in range(start, stop):
        tokens = data.sharded_batch(DATASET.train_batch, step, eng.batch_sharding(),
                                    DATASET.global_shape)
        state, metrics = eng.step(state, tokens)
        losses.append(float(metrics["train/loss"]))
        if step + 1 in save_at:
            ckpt.save(step + 1, eng.layout, state, {"note": "test run"})
    return state, losses


@functools.lru_cache(maxsize=1)
def initial_params():
    """The canonical initial parameters, built once (Flax init takes seconds here)."""
    return params()


def canonical_host(eng, state):
    return host(eng.layout.to_canonical(state))


def rel(a, b):
    return np.abs(np.asarray(a) - np.asarray(b)) / np.abs(np.asarray(b))


@pytest.fixture(scope="module")
def uninterrupted():
    eng = engine(*LAYOUT)
    state, losses = run(eng, eng.init_state(initial_params()), 0, STEPS)
    return eng, losses, canonical_of(eng, state["params"])


@pytest.fixture(scope="module")
def saved(uninterrupted, tmp_path_factory):
    """(folder, losses of the saving run, canonical state at step 6 on the host)."""
    eng = uninterrupted[0]
    folder = str(tmp_path_factory.mktemp("checkpoints"))
    ckpt = Checkpointer(folder, keep=2, async_save=True)
    state, losses = run(eng, eng.init_state(initial_params()), 0, SAVE_AT, ckpt, save_at={2, 4, 6})
    at_save = canonical_host(eng, state)
    # The next steps donate the state's buffers while the save may still be writing.
    state, more = run(eng, state, SAVE_AT, STEPS)
    ckpt.wait()
    ckpt.close()
    return folder, losses + more, at_save


def test_async_saves_do_not_disturb_training_and_keep_the_newest(uninterrupted, saved):
    folder, losses, _ = saved
    assert losses == uninterrupted[1]
    ckpt = Checkpointer(folder, keep=2)
    assert ckpt.complete_steps() == [4, 6]  # step 2 pruned by keep=2
    meta = ckpt.metadata(6)
    assert meta["step"] == 6 and meta["note"] == "test run"
    assert (meta["parallel"]["pipeline"], meta["parallel"]["data"],
            meta["parallel"]["tensor"]) == LAYOUT[:3]
    found = paths.locate(os.path.join(folder, "6")), paths.locate(folder)
    assert [(f.folder, f.step) for f in found] == [(folder, 6), (folder, None)]
    ckpt.close()


def test_resume_equals_uninterrupted_run(uninterrupted, saved):
    _, ref_losses, ref_params = uninterrupted
    fresh = engine(*LAYOUT)  # as in a new process: nothing shared with the saving run
    ckpt = Checkpointer(saved[0], keep=2)
    state = ckpt.restore(fresh.layout)
    ckpt.close()
    assert int(state["step"]) == SAVE_AT
    assert jax.tree.map(lambda a: a.sharding, state) == fresh.state_shardings
    state, losses = run(fresh, state, SAVE_AT, STEPS)
    assert np.max(rel(losses, ref_losses[SAVE_AT:])) <= 1e-6, (losses, ref_losses)
    final = canonical_of(fresh, state["params"])
    assert jax.tree.all(jax.tree.map(np.array_equal, final, ref_params))


# Another layout runs other float reductions (other psum trees, other matmul splits), so
# losses agree to float32 rounding, not bit for bit: 1e-5 relative.
@pytest.mark.parametrize("layout,kw", [((4, 1, 2, 4), {"stage_layers": (1, 3, 3, 1)}),
                                       ((1, 8, 1, 1), {}),
                                       ((2, 2, 2, 2), {"fsdp": True, "schedule": "1f1b"})],
                         ids=str)
def test_restore_under_another_layout_continues_the_same_run(layout, kw, uninterrupted, saved):
    """(4, 1, 2, 4): uneven stages, whose padding the canonical checkpoint never holds."""
    _, ref_losses, ref_params = uninterrupted
    eng = engine(*layout, **kw)
    ckpt = Checkpointer(saved[0], keep=2)
    state = ckpt.restore(eng.layout)
    ckpt.close()
    assert jax.tree.map(lambda a: a.sharding, state) == eng.state_shardings
    state, losses = run(eng, state, SAVE_AT, STEPS)
    assert np.max(rel(losses, ref_losses[SAVE_AT:])) <= 1e-5, (losses, ref_losses)
    assert worst(max_rel_err(canonical_of(eng, state["params"]), ref_params)) <= 1e-4


@pytest.mark.parametrize("kw", [
    dict(schedule="circular", virtual_stages=2, zero1=True, stage_layers=(3, 1, 2, 2)),
    dict(schedule="zb_h1", fsdp=True)], ids=["circular-zero1", "zb_h1-fsdp"])
def test_round_trip_through_a_sharded_layout_is_exact(kw, uninterrupted, saved, tmp_path):
    """Restored into interleaved, uneven chunks with ZeRO-1 (moments sharded over `data`),
    or into FSDP (parameters too, along other dimensions), saved again from there,
    restored into the original layout: bit-identical state."""
    _, _, at_save = saved
    circular = engine(2, 2, 2, 2, **kw)
    ckpt = Checkpointer(saved[0], keep=2)
    state = ckpt.restore(circular.layout)
    ckpt.close()
    assert jax.tree.map(lambda a: a.sharding, state) == circular.state_shardings
    assert jax.tree.all(jax.tree.map(np.array_equal, canonical_host(circular, state), at_save))
    again = Checkpointer(str(tmp_path), keep=1, async_save=False)
    again.save(SAVE_AT, circular.layout, state)
    back = again.restore(uninterrupted[0].layout)
    again.close()
    assert jax.tree.all(jax.tree.map(np.array_equal, canonical_host(uninterrupted[0], back),
                                     at_save))


def test_incomplete_checkpoints_are_never_picked(uninterrupted, saved, tmp_path):
    folder = str(tmp_path / "run")
    shutil.copytree(saved[0], folder)
    # A save cut short by a crash: Orbax's temporary folder, half written.
    tmp = os.path.join(folder, "8.orbax-checkpoint-tmp-1700000000000")
    shutil.copytree(os.path.join(folder, "6"), tmp)
    os.remove(os.path.join(tmp, "state", "manifest.ocdbt"))
    # A step folder without its completion markers (e.g. a partial copy by hand).
    shutil.copytree(os.path.join(folder, "6", "state"), os.path.join(folder, "9", "state"))
    ckpt = Checkpointer(folder, keep=2)
    assert ckpt.latest_step() == SAVE_AT
    assert 9 not in ckpt.complete_steps()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint of step 9"):
        ckpt.restore(uninterrupted[0].layout, step=9)
    state = ckpt.restore(uninterrupted[0].layout)
    ckpt.close()
    assert not os.path.exists(tmp)  # leftovers of the cut-short save are cleaned up
    assert jax.tree.all(jax.tree.map(np.array_equal,
                                     canonical_host(uninterrupted[0], state), saved[2]))


def test_an_empty_folder_has_no_checkpoint(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "none"))
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.restore(None)
    ckpt.close()


def test_resume_from_wins_unless_the_same_command_made_the_own_checkpoints(
        uninterrupted, saved, tmp_path):
    eng, other = uninterrupted[0], saved[0]
    own = Checkpointer(str(tmp_path / "own"), keep=2, async_save=False)
    resume_point = start.resume_point
    assert resume_point(TrainConfig(resume="auto"), own) is None
    assert resume_point(TrainConfig(resume="auto", resume_from=other), own) == (other, 6)
    step4 = os.path.join(other, "4")
    assert resume_point(TrainConfig(resume="never", resume_from=step4), own) == (other, 4)
    state = start.restore(resume_point(TrainConfig(resume_from=step4), own), own, eng)
    assert int(state["step"]) == 4
    # The run goes on and checkpoints into its own folder, recording where its chain
    # started: the same command again continues it; another resume_from wins.
    own.lineage = start.lineage_of(TrainConfig(resume_from=step4), own, None)
    own.save(5, eng.layout, state)
    assert resume_point(TrainConfig(resume_from=step4), own) == (own.directory, 5)
    assert resume_point(TrainConfig(), own) == (own.directory, 5)  # auto: its own
    assert resume_point(TrainConfig(resume_from=other), own) == (other, 6)
    own_step = os.path.join(own.directory, "5")
    assert resume_point(TrainConfig(resume_from=own_step), own) == (own.directory, 5)
    # A run folder stands for its checkpoints/ (papercut: <run>/checkpoints was needed).
    run_folder = tmp_path / "a_run"
    shutil.copytree(other, run_folder / "checkpoints")
    found = paths.locate(str(run_folder))
    assert (found.folder, found.step) == (str(run_folder / "checkpoints"), None)
    assert resume_point(TrainConfig(resume_from=str(run_folder)), own) == (
        str(run_folder / "checkpoints"), 6)
    empty = Checkpointer(str(tmp_path / "empty"))
    bad = [(TrainConfig(resume="never"), own, "train.resume=never but"),
           (TrainConfig(resume="sometimes"), own, "train.resume='sometimes' is not one of"),
           (TrainConfig(resume_from=str(tmp_path / "x")), empty, "is not a checkpoint folder"),
           (TrainConfig(resume_from=os.path.join(other, "5")), empty,
            "no complete checkpoint of step 5")]
    for train, ckpt, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            resume_point(train, ckpt)
    own.close()
    empty.close()


def test_resume_from_moves_newer_own_checkpoints_aside_and_a_named_damaged_step_is_an_error(
        uninterrupted, saved, tmp_path):
    eng = uninterrupted[0]
    source = Checkpointer(saved[0], read_only=True)
    state = source.restore(eng.layout, 4)
    source.close()
    own = Checkpointer(str(tmp_path / "own"), keep=3, async_save=False)
    own.save(5, eng.layout, state)
    own.save(7, eng.layout, state)
    step4 = os.path.join(saved[0], "4")
    point, notes = start.start_point(TrainConfig(resume_from=step4), own, primary=True)
    assert point == (saved[0], 4) and own.complete_steps() == []
    assert all(os.path.isdir(os.path.join(own.directory, f"{s}.superseded")) for s in (5, 7))
    assert len(notes) == 1 and "wins over this run's own newer checkpoints" in notes[0]
    # A step named explicitly is never replaced by another one when it is damaged.
    own.save(7, eng.layout, state)
    _flip_a_byte(os.path.join(own.directory, "7"))
    named = TrainConfig(resume_from=os.path.join(own.directory, "7"))
    with pytest.raises(DamagedCheckpoint) as damaged:
        own.restore(eng.layout, 7)
    with pytest.raises(ConfigError, match=r"resume_from=.*/7: the checkpoint of step 7 .* "
                                          r"is damaged: .*name another step"):
        start.fall_back(named, own, damaged.value, primary=True)
    assert own.complete_steps() == [7]  # left where it is
    own.close()


def _biggest_data_file(step_dir: str) -> str:
    files = [os.path.join(root, f) for root, _, names in os.walk(os.path.join(step_dir, "state"))
             for f in names if os.sep + "d" + os.sep in os.path.join(root, f)]
    return max(files, key=os.path.getsize)


def _truncate(step_dir):
    path = _biggest_data_file(step_dir)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_a_byte(step_dir):
    path = _biggest_data_file(step_dir)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGE = {
    "truncated data file": _truncate,
    "flipped byte": _flip_a_byte,
    "missing index (OCDBT manifest)": lambda d: os.remove(os.path.join(d, "state",
                                                                       "manifest.ocdbt")),
    "missing state/": lambda d: shutil.rmtree(os.path.join(d, "state")),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # TensorStore
def test_each_kind_of_damage_is_detected_and_the_previous_step_restores(
        kind, uninterrupted, saved, tmp_path):
    """Orbax alone restores a flipped byte silently (other values, no error): the
    fingerprints in the step's metadata catch it. The previous step still restores."""
    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], folder)
    DAMAGE[kind](os.path.join(folder, "6"))
    ckpt = Checkpointer(folder, keep=2)
    if kind == "flipped byte":  # Orbax alone reads other values without a word
        abstract = checkpoint.to_nested(uninterrupted[0].layout.abstract_canonical())
        want = jax.tree.leaves(checkpoint.to_nested(saved[2]))

        def same_as_saved(manager) -> bool:
            raw = manager.restore(6, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
            return all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(host(raw)), want))

        intact = Checkpointer(saved[0], read_only=True)
        assert same_as_saved(intact.manager)
        intact.close()
        assert not same_as_saved(ckpt.manager)
    with pytest.raises(DamagedCheckpoint, match="the checkpoint of step 6 in"):
        ckpt.restore(uninterrupted[0].layout, 6)
    assert int(ckpt.restore(uninterrupted[0].layout, 4)["step"]) == 4
    moved = ckpt.set_aside(6, "damaged")
    assert moved.endswith(os.path.join("ckpt", "6.damaged")) and os.path.isdir(moved)
    ckpt.reload()
    assert ckpt.latest_step() == 4  # the moved folder is never a step again
    ckpt.close()


def test_a_step_folder_without_its_marker_is_moved_aside_and_saved_again(
        uninterrupted, saved, tmp_path):
    eng = uninterrupted[0]
    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], folder)
    os.remove(os.path.join(folder, "6", "_CHECKPOINT_METADATA"))
    ckpt = Checkpointer(folder, keep=3, async_save=False)
    assert ckpt.incomplete_steps() == [6] and ckpt.latest_step() == 4
    assert not ckpt.save(6, eng.layout, ckpt.restore(eng.layout, 4))  # blocked while it is there
    ckpt.set_aside(6, "damaged")
    ckpt.reload()
    assert ckpt.save(6, eng.layout, ckpt.restore(eng.layout, 4))
    assert ckpt.complete_steps() == [4, 6] and os.path.isdir(folder + "/6.damaged")
    ckpt.close()


def test_a_non_finite_state_is_never_saved(uninterrupted, tmp_path):
    eng = uninterrupted[0]
    ckpt = Checkpointer(str(tmp_path), keep=2, async_save=False)
    state = eng.init_state(initial_params())
    ckpt.save(1, eng.layout, state)
    poisoned = dict(state, params=jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.nan),
                                                state["params"]))
    with pytest.raises(NonFiniteStateError, match="refusing to checkpoint step 2"):
        ckpt.save(2, eng.layout, poisoned)
    assert ckpt.complete_steps() == [1]
    ckpt.close()
