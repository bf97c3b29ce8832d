"""Mesh-independent Orbax checkpoints of the train state {params, opt_state, step}.

On disk the state is in the *canonical* layout (`framework/checkpoint_layout.py`):
layers stacked on one `layers` axis, no stage or chunk axis, for the parameters and
for every optimizer leaf that mirrors them (AdamW mu/nu). A checkpoint written under one
(pipeline, data, tensor, schedule, zero1) therefore restores under any other valid
one: Orbax reads each array straight into the new engine's canonical shardings (each
process reads only the pieces its devices hold), then one jitted reshuffle puts it in
the new train layout.

Saves go through `ocp.CheckpointManager`: asynchronous (`save` blocks only while the
canonical copy is made and moved to host memory; files are written in the background;
the copy is a separate buffer, so the next train step may donate the state), atomic (a
step is written to `<step>.orbax-checkpoint-tmp-*` and renamed when complete, so a
crash mid-save leaves the previous checkpoint as the newest), `keep` newest retained.
Each step also holds `metadata` (JSON: step, degrees, model, and what the caller adds).
Cost: while a save is being staged the devices hold one extra copy of the state.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from framework.checkpoint_layout import (abstract_canonical_state, canonical_shardings,
                                         to_canonical, to_train)
from framework.config import ConfigError, TrainConfig
from framework.engine import Engine

STATE, METADATA = "state", "metadata"  # the two items of every checkpoint step
# Written by Orbax (the step's own metadata) and by us, inside the atomic step folder:
# a step folder missing either (e.g. copied by hand, or half-written on a filesystem
# without atomic rename) is never picked.
COMPLETE_MARKERS = ("_CHECKPOINT_METADATA", os.path.join(METADATA, "metadata"))


# --- Trees with string keys only (what Orbax stores, independent of optax classes) ----

def _name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise TypeError(f"unexpected pytree key {key!r}")


def to_nested(tree) -> dict:
    """Any pytree -> nested dicts keyed by field names / indices ('0', 'mu', ...)."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        node = out
        for key in path[:-1]:
            node = node.setdefault(_name(key), {})
        node[_name(path[-1])] = leaf
    return out


def from_nested(nested: dict, like):
    """Inverse of `to_nested`, with the structure (optax states, ...) of `like`."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = []
    for path, _ in paths:
        node = nested
        for key in path:
            node = node[_name(key)]
        leaves.append(node)
    return jax.tree.unflatten(treedef, leaves)


def all_finite(tree) -> jax.Array:
    """True iff every floating-point value in `tree` is finite (one device reduction)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


# --- The checkpointer ----------------------------------------------------------------

class NonFiniteStateError(ValueError):
    """A train state with NaN/inf values was about to be checkpointed."""


class Checkpointer:
    """Saves and restores train states under `directory/<step>/{state,metadata}`.

    Every process must call `save`/`restore` (each writes/reads its own shards).
    """

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True,
                 read_only: bool = False):
        if "://" not in directory:  # local; remote (gs://...) paths are kept as given
            directory = os.path.abspath(os.path.expanduser(directory))
        self.directory = directory
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,  # leftovers of a save cut short
            create=not read_only,
            read_only=read_only,  # e.g. another run's folder (train.resume_from)
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={STATE: ocp.StandardCheckpointHandler(),
                           METADATA: ocp.JsonCheckpointHandler()})
        self._converters: dict[int, tuple[Engine, Callable, Callable]] = {}

    def _jitted(self, engine: Engine) -> tuple[Callable, Callable]:
        """(train -> canonical, canonical -> train), jitted once per engine."""
        if id(engine) not in self._converters or self._converters[id(engine)][0] is not engine:
            save = jax.jit(lambda s: (to_canonical(s), all_finite(s)),
                           out_shardings=(canonical_shardings(engine), None))
            load = jax.jit(lambda c: to_train(engine, c), out_shardings=engine.state_shardings)
            self._converters[id(engine)] = (engine, save, load)
        return self._converters[id(engine)][1:]

    def save(self, step: int, engine: Engine, state, metadata: dict | None = None) -> bool:
        """Starts saving `state` as step `step` (returns once the arrays are off the
        devices, so the next train step may donate them). False if `step` is saved.
        Raises NonFiniteStateError, saving nothing, if any parameter or optimizer value
        is NaN/inf: the last good checkpoint stays the newest."""
        if step in self.manager.all_steps():
            return False
        canonical, finite = self._jitted(engine)[0](state)
        if not bool(finite):
            raise NonFiniteStateError(f"refusing to checkpoint step {step}: the parameters "
                                      f"or optimizer state hold NaN or inf")
        meta = {"step": int(step), "parallel": dataclasses.asdict(engine.parallel),
                "model": dataclasses.asdict(engine.model), **(metadata or {})}
        return self.manager.save(step, force=True, args=ocp.args.Composite(**{
            STATE: ocp.args.StandardSave(to_nested(canonical)),
            METADATA: ocp.args.JsonSave(meta)}))

    def complete_steps(self) -> list[int]:
        """Steps whose save finished (async saves still in flight are not listed)."""
        steps = [s for s in self.manager.all_steps() if self._is_complete(s)]
        return sorted(steps)

    def _is_complete(self, step: int) -> bool:
        folder = epath.Path(self.directory) / str(step)
        return all((folder / marker).exists() for marker in COMPLETE_MARKERS)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int | None = None) -> dict:
        step = self._pick(step)
        return self.manager.restore(step, args=ocp.args.Composite(
            **{METADATA: ocp.args.JsonRestore()}))[METADATA]

    def restore(self, engine: Engine, step: int | None = None):
        """The train state of `step` (default: the newest complete one), laid out and
        sharded for `engine`, whatever layout it was saved from."""
        step = self._pick(step)
        abstract = abstract_canonical_state(engine)
        restored = self.manager.restore(step, args=ocp.args.Composite(**{
            STATE: ocp.args.StandardRestore(to_nested(abstract))}))[STATE]
        return self._jitted(engine)[1](from_nested(restored, abstract))

    def restore_params(self, step: int, abstract_params):
        """Only the canonical parameters of `step` (not the optimizer state), with the
        shapes and shardings of `abstract_params` (ShapeDtypeStructs): for generation and
        export, which need a third of what a full restore reads."""
        step = self._pick(step)
        item = {"params": to_nested(abstract_params)}
        args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), item)
        path = epath.Path(self.directory) / str(step) / STATE
        restored = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True))
        return from_nested(restored["params"], abstract_params)

    def _pick(self, step: int | None) -> int:
        complete = self.complete_steps()
        if step is None:
            if not complete:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
            return complete[-1]
        if step not in complete:
            raise FileNotFoundError(f"no complete checkpoint of step {step} in "
                                    f"{self.directory} (complete: {complete})")
        return step

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


RESUME_MODES = ("auto", "never")


def resume_point(train: TrainConfig, own: Checkpointer) -> tuple[str, int] | None:
    """Where a run starts from: (checkpoint folder, step), or None for a fresh start.

    `train.resume=auto`: the newest complete checkpoint in the run's own folder (`own`)
    wins, so a preempted run that began from another run continues from its own
    progress; else `train.resume_from` (a folder, or one step folder inside it); else
    fresh. `train.resume=never`: only `train.resume_from`, if set, and the own folder
    must hold no checkpoint (new saves would mix with, or be pruned among, old ones).
    """
    if train.resume not in RESUME_MODES:
        raise ConfigError(f"train.resume={train.resume!r} is not one of "
                          f"{', '.join(RESUME_MODES)}")
    latest = own.latest_step()
    if latest is not None:
        if train.resume == "auto":
            return own.directory, latest
        raise ConfigError(f"train.resume=never but {own.directory} already holds a "
                          f"checkpoint (step {latest}): use another output folder or "
                          f"train.resume=auto")
    if train.resume_from:
        folder, step = locate(train.resume_from)
        other = Checkpointer(folder, async_save=False, read_only=True)
        try:
            step = other._pick(step)
        except FileNotFoundError as err:
            raise ConfigError(f"train.resume_from={train.resume_from}: {err}") from None
        finally:
            other.close()
        return folder, step
    return None


def resume(train: TrainConfig, own: Checkpointer, engine: Engine):
    """The restored train state (on `engine`'s layout) per `resume_point`, or None."""
    point = resume_point(train, own)
    if point is None:
        return None
    folder, step = point
    if folder == own.directory:
        return own.restore(engine, step)
    other = Checkpointer(folder, async_save=False, read_only=True)
    try:
        return other.restore(engine, step)
    finally:
        other.close()


def locate(path: str) -> tuple[str, int | None]:
    """`train.resume_from`: a checkpoint folder (its newest step) or one step folder
    inside it (named by its step) -> (folder, step or None)."""
    path = os.path.abspath(os.path.expanduser(path)).rstrip(os.sep)
    parent, name = os.path.split(path)
    looks_like_step = any(os.path.exists(os.path.join(path, m)) for m in (STATE, *COMPLETE_MARKERS))
    if name.isdigit() and os.path.isdir(parent) and (looks_like_step or not os.path.exists(path)):
        return parent, int(name)
    if not os.path.isdir(path):
        raise ConfigError(f"train.resume_from={path} is not a checkpoint folder")
    return path, None
