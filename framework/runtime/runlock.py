"""One run per folder: an exclusive lock file that also works on shared filesystems.

A run holds `<run folder>/run.lock` from before JAX starts until it exits (and, when
`checkpoint.dir` lies outside the run folder, `<checkpoint.dir>/run.lock` too). A
second run on the same folder is refused with one line naming the folder and the
holder; the first goes on untouched.

Taking the lock. The holder's description (host, pid, start time, boot id, the
process's start tick) is written to a uniquely named file beside the lock, which is
then hard-linked to `run.lock`: link(2) either creates the name or fails, atomically,
on local filesystems and on NFS/Lustre, where O_CREAT|O_EXCL was not always atomic and
flock() is often not shared between hosts. A reader therefore never sees a half-written
lock. (Filesystems without hard links fall back to O_CREAT|O_EXCL.)

Stale locks. A run killed with SIGKILL (or a crashed host) leaves its lock behind. The
lock is stale, and the next run takes it over, when
  * same host (same hostname, and the same boot id where Linux reports one): the pid no
    longer runs, or runs a different process (its start tick differs), or the machine
    was rebooted since;
  * another host: its heartbeat is older than STALE_AFTER_S. The holder touches the lock
    file every HEARTBEAT_S seconds (a daemon thread); the age is measured against the
    file server's clock (the mtime of a file just written beside it), so clocks of the
    hosts need not agree.
Taking over renames the stale lock aside (atomic; of two runs doing it at once one
wins the rename) and checks that what it moved was the lock it judged stale.

Multi-process runs: process 0 holds the lock for the run; the others follow its
decision (`framework/run/train.py` broadcasts it with `distributed.agree`).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import secrets
import socket
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from framework.errors import ConfigError, FolderBusy

LOCK_FILE = "run.lock"
HEARTBEAT_S = 15.0  # how often the holder touches its lock
STALE_AFTER_S = 120.0  # a lock from another host with an older heartbeat is stale


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str  # local time the lock was taken, e.g. 2026-11-23 13:20:01
    boot_id: str | None = None  # Linux: /proc/sys/kernel/random/boot_id
    proc_start: str | None = None  # Linux: start tick of the process (/proc/<pid>/stat)

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> str | None:
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # Field 22 (starttime); fields after the command name, which may hold spaces.
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def me() -> Holder:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return Holder(socket.gethostname(), os.getpid(), now,
                  _read("/proc/sys/kernel/random/boot_id"), _proc_start(os.getpid()))


def _parse(text: str | None) -> Holder | None:
    try:
        fields = json.loads(text or "")
        return Holder(**{k: fields.get(k) for k in Holder.__dataclass_fields__})
    except (ValueError, TypeError, AttributeError):
        return None


def _alive_here(holder: Holder) -> bool:
    """Whether the holder, on this host, still runs."""
    mine = me()
    if holder.boot_id and mine.boot_id and holder.boot_id != mine.boot_id:
        return False  # rebooted since
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # runs, as another user
    start = _proc_start(holder.pid)
    return not (holder.proc_start and start and start != holder.proc_start)  # pid reused


def stale_reason(holder: Holder | None, age_s: float) -> str | None:
    """Why a lock with this content, last touched `age_s` seconds ago, is stale (None:
    it is live). A lock that cannot be read is judged by its age alone."""
    if holder is not None and holder.host == socket.gethostname():
        return None if _alive_here(holder) else f"pid {holder.pid} no longer runs"
    if age_s > STALE_AFTER_S:
        return f"no heartbeat for {age_s:.0f} s"
    return None


def _link_exclusive(path: Path, content: str) -> tuple[bool, float]:
    """Creates `path` with `content` unless it exists (atomically); returns (created,
    the file server's current time)."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}."
                         f"{secrets.token_hex(4)}")
    try:
        with open(tmp, "w") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        now = os.stat(tmp).st_mtime
        try:
            os.link(tmp, path)
            return True, now
        except FileExistsError:
            return False, now
        except OSError:
            if os.stat(tmp).st_nlink == 2:  # NFS: linked, but the reply was lost
                return True, now
            if os.path.exists(path):
                return False, now
            return _create_exclusive(path, content), now  # no hard links here
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _create_exclusive(path: Path, content: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(content)
    return True


def _take_over(path: Path, inode: int) -> None:
    """Moves the stale lock (inode `inode`) aside; puts back a live one moved by mistake."""
    aside = path.with_name(f".{path.name}.stale.{socket.gethostname()}.{os.getpid()}."
                           f"{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another run took it over first
    if os.stat(aside).st_ino != inode:  # a fresh lock appeared in between: restore it
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    os.unlink(aside)


class RunLock:
    """The held lock of one folder; `release()` removes it (only if still ours)."""

    def __init__(self, path: Path, holder: Holder):
        self.path, self.holder = path, holder
        self.inode = os.stat(path).st_ino
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat",
                                      daemon=True)
        self._beat.start()

    def _ours(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self._ours():
                try:
                    os.utime(self.path)
                except OSError:
                    pass

    def release(self) -> None:
        self._stop.set()
        if self._ours():
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _remedy(folder: Path, err: OSError) -> str:
    """What to do about a folder whose lock cannot be written."""
    in_the_way = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()),
                      None)
    if in_the_way is not None:
        return f"{in_the_way} is a file, not a folder: choose a folder"
    if err.errno == errno.ENOSPC or err.errno == errno.EDQUOT:
        return "free space there, or choose a folder on another disk"
    return "choose a folder this user can create and write"


def acquire(folder: str | os.PathLike) -> RunLock:
    """Takes `folder`'s lock (creating the folder) or raises FolderBusy naming the holder."""
    folder = Path(folder)
    path = folder / LOCK_FILE
    holder = me()
    for _ in range(5):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            created, now = _link_exclusive(path, json.dumps(asdict(holder)))
        except OSError as err:  # a full disk, a read-only folder, a file in the way
            raise ConfigError(f"cannot write the run's lock file {path}: {err.strerror} "
                              f"(errno {err.errno}): {_remedy(folder, err)} "
                              f"(hydra.run.dir=..., checkpoint.dir=...)") from None
        if created:
            return RunLock(path, holder)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue  # released meanwhile
        other = _parse(_read(str(path)))
        if stale_reason(other, now - st.st_mtime) is None:
            who = other.describe() if other else "an unreadable lock"
            raise FolderBusy(f"{folder} is in use by another run ({who}; lock file "
                             f"{path}): wait for it to end, stop it, or choose another "
                             f"folder (hydra.run.dir=...)")
        _take_over(path, st.st_ino)
    raise FolderBusy(f"could not take the lock {path}: other runs keep taking it")


def holder(folder: str | os.PathLike) -> Holder | None:
    """The live run holding `folder`, or None (no lock, or a stale one)."""
    path = Path(folder) / LOCK_FILE
    try:
        st = os.stat(path)
    except OSError:
        return None
    other = _parse(_read(str(path)))
    probe = path.with_name(f".{LOCK_FILE}.probe.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        probe.touch()
        now = os.stat(probe).st_mtime
        probe.unlink()
    except OSError:
        import time

        now = time.time()
    if stale_reason(other, now - st.st_mtime) is not None:
        return None
    return other or Holder("unknown", -1, "unknown")


class Guard:
    """The locks of a run's folders, held by process 0. `take()` (process 0, as early
    as its index is known) tries them; `settle(process_index)` takes them if not yet
    tried, gives every process process 0's verdict and raises FolderBusy if refused."""

    def __init__(self, folders: list[str]):
        self.folders = folders
        self.locks: list[RunLock] = []
        self.refusal: str | None = None
        self.tried = False

    def take(self) -> None:
        self.tried = True
        try:
            for folder in self.folders:
                self.locks.append(acquire(folder))
        except FolderBusy as err:
            self.release()
            self.refusal = str(err)

    def settle(self, process_index: int, process_count: int) -> None:
        if process_index == 0 and not self.tried:
            self.take()
        refusal = self.refusal
        if process_count > 1:  # needs the started backend
            from framework.runtime import distributed

            refusal = distributed.agree(refusal)
        if refusal:
            self.release()
            raise FolderBusy(refusal)

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
