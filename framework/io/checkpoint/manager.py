"""Mesh-independent Orbax checkpoints of the train state {params, opt_state, step}.

On disk the state is in the *canonical* layout (`framework/engine/state.py`):
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

Integrity (`framework/io/checkpoint/integrity.py`): each step's metadata also lists a
fingerprint of every array; `restore` checks that every expected array is listed, lets
Orbax read them (its own checks catch truncated files and missing manifests), and
compares the fingerprints (flipped bytes). Anything wrong raises `DamagedCheckpoint`;
the run moves that step aside as `<step>.damaged` and falls back to the previous one
(`framework/run/start.py`). A failed background save (disk full, permissions, quota) is
noticed at the next step boundary (`failed_save`) and raised as `StorageError`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
from etils import epath

from framework.errors import DamagedCheckpoint, NonFiniteStateError, StorageError
from framework.io.checkpoint import integrity
from framework.io.checkpoint.paths import COMPLETE_MARKERS, METADATA, STATE
from framework.model import fp8_delayed
from framework.runtime import distributed



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


def _missing(saved: dict | None, expected: list[str]) -> tuple[list[str], list[str]]:
    """(the arrays `expected` that the checkpoint lacks, the delayed FP8 scaling
    histories it lacks): a run without histories saved none, and they start empty."""
    gone = integrity.missing(saved, expected)
    fresh = [k for k in gone if k.endswith(fp8_delayed.HISTORY)]
    return [k for k in gone if k not in fresh], fresh


def all_finite(tree) -> jax.Array:
    """True iff every floating-point value in `tree` is finite (one device reduction)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


# --- The checkpointer ----------------------------------------------------------------

DETAILS = logging.getLogger("framework.details")  # run.log only (framework/runtime/faults.py)


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
        self._converters: dict[int, tuple] = {}
        self._saving: int | None = None  # step of the save started last, until checked
        # What saves cost (summary.json: checkpoint/*): seconds the caller was blocked
        # (copy off the devices, fingerprints, waiting for the previous save), seconds
        # from start to noticed completion of the background writes.
        self.stats = {"saves": 0, "blocked_s": 0.0, "written_s": 0.0}
        self._started: float | None = None
        self._failure: str | None = None  # why a save failed (then the run must stop)
        self.needed_bytes: int | None = None  # size of the state a checkpoint holds
        self.warned = False  # the low-space warning was shown
        # Recorded in every save's metadata: the train.resume_from this chain of runs
        # started from (framework/run/start.py), so the same command continues it.
        self.lineage: str | None = None

    def _jitted(self, layout) -> tuple[Callable, Callable, Callable]:
        """(train -> canonical + checks, canonical -> train, canonical -> fingerprints),
        jitted once per state layout."""
        if id(layout) not in self._converters or self._converters[id(layout)][0] is not layout:
            def to_disk(s):
                canonical = layout.to_canonical(s)
                return canonical, all_finite(s), integrity.fingerprints(to_nested(canonical))

            save = jax.jit(to_disk, out_shardings=(layout.canonical_shardings, None, None))
            load = jax.jit(layout.to_train, out_shardings=layout.shardings)
            check = jax.jit(lambda c: integrity.fingerprints(to_nested(c)))
            self._converters[id(layout)] = (layout, save, load, check)
        return self._converters[id(layout)][1:]

    def save(self, step: int, layout, state, metadata: dict | None = None) -> bool:
        """Starts saving `state` as step `step` (returns once the arrays are off the
        devices, so the next train step may donate them). False if `step` is saved.
        Raises NonFiniteStateError, saving nothing, if any parameter or optimizer value
        is NaN/inf: the last good checkpoint stays the newest. Raises StorageError if
        an earlier save failed, or (synchronous saves) this one."""
        self.raise_if_save_failed()
        if step in self.manager.all_steps():
            return False
        began = time.perf_counter()
        canonical, finite, prints = self._jitted(layout)[0](state)
        if not bool(finite):
            raise NonFiniteStateError(f"refusing to checkpoint step {step}: the parameters "
                                      f"or optimizer state hold NaN or inf")
        self.needed_bytes = integrity.tree_bytes(canonical)
        meta = {"step": int(step), "parallel": dataclasses.asdict(layout.parallel),
                "model": dataclasses.asdict(layout.model), "resume_from": self.lineage,
                **(metadata or {}), "fingerprints": integrity.to_json(prints)}
        self.wait()  # Orbax would wait for the previous save too; a failure is its own
        self._saving, self._started = step, began
        try:
            saved = self.manager.save(step, force=True, args=ocp.args.Composite(**{
                STATE: ocp.args.StandardSave(to_nested(canonical)),
                METADATA: ocp.args.JsonSave(meta)}))
        except Exception as err:  # a synchronous save failed
            raise self._failed(err) from None
        self.stats["saves"] += 1
        self.stats["blocked_s"] += time.perf_counter() - began
        return saved

    # --- Failed saves (disk full, permissions, quota) ---------------------------------

    def _failed(self, err: BaseException) -> StorageError:
        DETAILS.info("checkpoint save failed", exc_info=err)
        if self._failure is None:
            step = self._saving
            free = integrity.free_bytes(self.directory)
            latest = self.latest_step()
            newest = (f"the newest good checkpoint is step {latest} (untouched)"
                      if latest is not None else "no checkpoint was saved before")
            self._failure = (
                f"could not save the checkpoint of step {step} in {self.directory}: "
                f"{integrity.short_reason(err)}; a checkpoint needs about "
                f"{integrity.megabytes(self.needed_bytes)}, "
                f"{integrity.megabytes(free)} free there; {newest}")
        return StorageError(self._failure)

    def failed_save(self) -> str | None:
        """Why the save started last failed, once it has ended; None while it runs or
        after it succeeded. Never blocks."""
        if self._failure is None and self._saving is not None \
                and not self.manager.is_saving_in_progress():
            try:
                self.manager.wait_until_finished()  # returns at once; raises its error
                self._written()
            except Exception as err:
                self._failed(err)
        return self._failure

    def _written(self) -> None:
        if self._saving is not None and self._started is not None:
            self.stats["written_s"] += time.perf_counter() - self._started
        self._saving = self._started = None

    def raise_if_save_failed(self) -> None:
        if self.failed_save() is not None:
            raise StorageError(self._failure)

    def low_space_warning(self) -> str | None:
        """A warning when the checkpoint folder has less free space than the last
        checkpoint took (local folders only)."""
        free = integrity.free_bytes(self.directory)
        if free is None or self.needed_bytes is None or free >= self.needed_bytes:
            return None
        return (f"warning: {integrity.megabytes(free)} free in {self.directory}, a "
                f"checkpoint needs about {integrity.megabytes(self.needed_bytes)}: the "
                f"next save will likely fail")

    # --- Which steps exist -------------------------------------------------------------

    def complete_steps(self) -> list[int]:
        """Steps whose save finished (async saves still in flight are not listed)."""
        steps = [s for s in self.manager.all_steps() if self._is_complete(s)]
        return sorted(steps)

    def incomplete_steps(self) -> list[int]:
        """Step folders missing a completion marker (not Orbax's temporary ones)."""
        return sorted(s for s in self.manager.all_steps() if not self._is_complete(s)
                      and s != self._saving)

    def _is_complete(self, step: int) -> bool:
        folder = epath.Path(self.directory) / str(step)
        return all((folder / marker).exists() for marker in COMPLETE_MARKERS)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def set_aside(self, step: int, label: str) -> str:
        """Moves step folder `step` to `<step>.<label>` (process 0 only; every process
        then calls `reload`). Returns the new path."""
        return integrity.set_aside(self.directory, str(step), label)

    def reload(self) -> None:
        """Re-reads the step folders (after some were moved aside)."""
        self.manager.reload()

    # --- Restore -----------------------------------------------------------------------

    def metadata(self, step: int | None = None) -> dict:
        step = self.pick(step)
        return self.manager.restore(step, args=ocp.args.Composite(
            **{METADATA: ocp.args.JsonRestore()}))[METADATA]

    def saved_dtypes(self, step: int) -> dict:
        """{"params/embed/table": "float32", ...}: each array's dtype as saved, from
        Orbax's own metadata of the step (every checkpoint has it)."""
        return integrity.dtypes(self.manager.item_metadata(step)[STATE])

    def restore(self, layout, step: int | None = None):
        """The train state of `step` (default: the newest complete one), laid out and
        sharded for `engine`, whatever layout it was saved from. Raises
        DamagedCheckpoint (on every process) if it is not what was saved."""
        step = self.pick(step)
        abstract = layout.abstract_canonical()
        expected = integrity.array_keys(to_nested(abstract))
        restored, saved, error, fresh = None, None, None, []
        try:
            saved = self.metadata(step).get("fingerprints")
            gone, fresh = _missing(saved, expected)
            if gone:
                error = f"it holds no array {gone[0]} ({len(gone)} missing)"
            else:  # read as saved; `to_train` casts to this layout's dtypes
                # (and histories this run keeps none of: read, then left out)
                extra = [k for k in (saved or {}) if k not in expected
                         and k.endswith(fp8_delayed.HISTORY)]
                reading = integrity.as_saved(integrity.without(to_nested(abstract), fresh),
                                             self.saved_dtypes(step))
                reading = self._also(reading, step, extra, layout.mesh)
                restored = integrity.with_zeros(integrity.without(self.manager.restore(
                    step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(reading)})
                )[STATE], extra), to_nested(abstract), fresh)
        except Exception as err:  # what Orbax/TensorStore say about unreadable files
            DETAILS.info("restoring step %s of %s failed", step, self.directory, exc_info=err)
            error = integrity.short_reason(err)
        error = distributed.first_error(error)  # the same verdict on every process
        if error:
            raise DamagedCheckpoint(self.directory, step, error)
        canonical = from_nested(restored, abstract)
        differ = integrity.mismatched(saved, self._jitted(layout)[2](canonical))
        if differ:
            raise DamagedCheckpoint(self.directory, step,
                                    f"{len(differ)} of {len(expected)} arrays differ from "
                                    f"what was saved ({', '.join(differ[:3])}"
                                    f"{', ...' if len(differ) > 3 else ''})")
        return self._jitted(layout)[1](canonical)

    def _also(self, reading: dict, step: int, keys: list[str], mesh) -> dict:
        """`reading` with the saved arrays `keys` added as the checkpoint's metadata
        describes them (replicated on `mesh`)."""
        if not keys:
            return reading
        meta = self.manager.item_metadata(step)[STATE]
        for key in keys:
            node, last = integrity.at(reading, key, make=True)
            info = integrity.at(meta, key)[0][last]
            node[last] = jax.ShapeDtypeStruct(tuple(info.shape), info.dtype,
                                              sharding=NamedSharding(mesh, P()))
        return reading

    def restore_params(self, step: int, abstract_params):
        """Only the canonical parameters of `step` (not the optimizer state), with the
        shapes and shardings of `abstract_params` (ShapeDtypeStructs): for generation and
        export, which need a third of what a full restore reads. Checked against the
        saved fingerprints like `restore`: raises DamagedCheckpoint if not as saved."""
        step = self.pick(step)
        path = epath.Path(self.directory) / str(step) / STATE
        try:
            saved = self.metadata(step).get("fingerprints")  # read as saved, cast once checked
            wanted = {"params": to_nested(abstract_params)}
            gone, fresh = _missing(saved, integrity.array_keys(wanted))
            if gone:
                raise DamagedCheckpoint(self.directory, step, f"it holds no array {gone[0]} "
                                                              f"({len(gone)} missing)")
            item = integrity.as_saved(integrity.without(wanted, fresh), self.saved_dtypes(step))
            args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding,
                                                               dtype=s.dtype), item)
            restored = integrity.with_zeros(ocp.PyTreeCheckpointer().restore(
                path, args=ocp.args.PyTreeRestore(item=item, restore_args=args,
                                                  partial_restore=True)), wanted, fresh)
        except DamagedCheckpoint:
            raise
        except Exception as err:  # what Orbax/TensorStore say about unreadable files
            DETAILS.info("restoring step %s of %s failed", step, self.directory, exc_info=err)
            raise DamagedCheckpoint(self.directory, step, integrity.short_reason(err)) from None
        prints = jax.jit(lambda r: integrity.fingerprints(r))(restored)
        differ = integrity.mismatched(saved, prints)
        if differ:
            raise DamagedCheckpoint(self.directory, step,
                                    f"{len(differ)} of {len(prints)} parameter arrays differ "
                                    f"from what was saved ({', '.join(differ[:3])})")
        return jax.tree.map(lambda x, a: x.astype(a.dtype),
                            from_nested(restored["params"], abstract_params), abstract_params)

    def pick(self, step: int | None) -> int:
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
        """Blocks until every started save is on disk; StorageError if one failed."""
        self.raise_if_save_failed()
        try:
            self.manager.wait_until_finished()
        except Exception as err:
            raise self._failed(err) from None
        self._written()

    def close(self) -> None:
        """Waits for saves in flight, then closes (a failed save was already reported)."""
        try:
            self.manager.close()
        except Exception as err:
            if self._failure is None:
                raise self._failed(err) from None
