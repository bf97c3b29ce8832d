"""When one process of a multi-process run dies, the others say so in one line.

What decides that a peer is gone is JAX's distributed runtime, not us: every process
sends heartbeats to the coordination service (hosted by process 0); a process silent
for `distributed.heartbeat_timeout_s` is declared dead and the service ends every other
process (native `abort`, exit status 134), and when process 0 itself dies its service
goes with it and the others end at once. Collectives with the dead process fail sooner
(gloo on CPU: "Connection reset by peer"; NCCL on GPUs hangs until the heartbeat verdict).

That verdict arrives as twenty-odd lines of C++ logging and a stack trace, from a
background thread, followed by SIGABRT: nothing in the dying process can turn it into
one line. So a multi-process run starts a small watcher process (`watch`) that reads
the run's native stderr (file descriptor 2, re-pointed into a pipe; Python's own
messages keep going to the terminal), appends it to run.log, and when the pipe closes
after JAX's verdict, prints the one line: which process vanished, at which step, the
newest complete checkpoint and any half-written save. The lowest-numbered survivor's
watcher also marks `summary.json` failed with that reason.

A survivor whose own step fails first (gloo's error) waits for the verdict
(`await_verdict`) instead of reporting a misleading error of its own.

    python -m framework.runtime.peers '<json settings>'   (started by `watch`)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

TELL = "\x1eframework-peers "  # a line the run writes into the pipe for the watcher
_WATCHED: list[bool] = []  # [True] once this process's stderr goes to a watcher
HEARTBEATS = re.compile(r"Task (\d+) heartbeat timeout")
UNHEALTHY = "The following tasks are unhealthy"
SERVICE_GONE = ("Socket closed", "Connection refused", "Connection reset", "Broken pipe",
                "failed to connect to all addresses")  # gRPC: the service is unreachable
JAX_VERDICT = "JAX distributed service detected fatal errors"
PEER_ERRORS = ("Gloo", "Connection reset by peer", "Connection closed by peer",
               "coordination service", "NCCL", "heartbeat")


# --- The run's side ----------------------------------------------------------------------

def watch(settings: dict) -> None:
    """Starts the watcher and sends this process's native stderr to it. `settings`:
    run_dir, log (run.log's path), checkpoints, markers (files a complete checkpoint
    step folder has), processes (count, or None until `tell`), process (index or None).
    Call before JAX starts its distributed runtime."""
    from framework.runtime import quiet

    read, write = os.pipe()
    subprocess.Popen([sys.executable, "-m", "framework.runtime.peers", json.dumps(settings)],
                     stdin=read, stdout=subprocess.DEVNULL, close_fds=True,
                     start_new_session=True)  # Ctrl-C at the terminal is the run's alone
    os.close(read)
    quiet.native_stderr_into(write)
    os.close(write)
    _WATCHED.append(True)


def tell(**facts) -> None:
    """Passes facts (process, processes) to the watcher, once JAX knows them."""
    if not _WATCHED:
        return
    try:
        os.write(2, (TELL + json.dumps(facts) + "\n").encode())
    except OSError:
        pass


def looks_like_peer_loss(err: BaseException) -> bool:
    text = f"{err} {err.__cause__ or ''} {err.__context__ or ''}"
    return any(word in text for word in PEER_ERRORS)


def await_verdict(err: BaseException, seconds: float) -> None:
    """After a collective failed with what looks like a vanished peer: wait (at most
    `seconds`) for JAX's runtime to confirm it and end this process; the watcher then
    says which peer. Returns if no verdict came (the error is then reported as usual)."""
    if looks_like_peer_loss(err):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.5)


# --- The watcher's side --------------------------------------------------------------------

def verdict(lines: list[str], me: int | None) -> list[int] | None:
    """The processes JAX's runtime declared gone in the native log `lines` (None: no
    verdict; [] when one was given without naming a process)."""
    dead: set[int] = set()
    seen = False
    for i, line in enumerate(lines):
        for match in HEARTBEATS.finditer(line):
            dead.add(int(match.group(1)))
        if UNHEALTHY in line:
            seen = True
            for after in lines[i + 1:i + 9]:
                if not after.strip().isdigit():
                    break
                dead.add(int(after.strip()))
        near = " ".join(lines[i:i + 3])  # gRPC's details follow on the next lines
        if "coordination" in line.lower() and any(s in near for s in SERVICE_GONE):
            dead.add(0)  # the service lives in process 0: it went with it
        seen = seen or JAX_VERDICT in line
    dead.discard(me)
    return sorted(dead) if dead or seen else None


def _newest_steps(folder: str, markers: list[str]) -> tuple[int | None, list[str]]:
    """(newest complete checkpoint step, names of half-written step folders)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None, []
    done, partial = [], []
    for name in names:
        head = name.split(".", 1)[0]
        if not head.isdigit():
            continue
        complete = name.isdigit() and all(
            os.path.exists(os.path.join(folder, name, m)) for m in markers)
        (done.append(int(name)) if complete else partial.append(name))
    return (max(done) if done else None), sorted(partial)


def _last_step(run_dir: str) -> int | None:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), "rb") as f:
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def line_for(dead: list[int], settings: dict) -> str:
    """The one line a survivor prints."""
    n = settings.get("processes")
    of = f" of {n}" if n else ""
    who = (" and ".join(f"process {p}{of}" for p in dead) if dead
           else "a process of this run")
    why = ("JAX's distributed service went with it" if dead == [0] else
           f"no heartbeat for {settings.get('heartbeat_timeout_s', '?')} s")
    step = _last_step(settings["run_dir"])
    at = f" after step {step}" if step is not None else ""
    newest, partial = _newest_steps(settings["checkpoints"], settings.get("markers", []))
    where = (f"the newest complete checkpoint is step {newest} in {settings['checkpoints']}"
             if newest is not None else "no checkpoint was completed")
    left = (f" ({', '.join(partial)}: unfinished, never read)" if partial else "")
    return (f"error: {who} vanished{at} ({why}); {where}{left}; restart every process "
            f"with the same command to resume")


def _mark_summary(settings: dict, reason: str) -> None:
    """summary.json: status failed with `reason`, replaced whole (temporary + rename)."""
    path = os.path.join(settings["run_dir"], "summary.json")
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        summary = {}
    step = _last_step(settings["run_dir"])
    summary.update(status="failed", reason=reason)
    if step is not None:
        summary["step"] = max(step, summary.get("step") or 0)
    tmp = f"{path}.peers.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _read(settings: dict) -> list[str]:
    """Copies stdin (the run's native stderr) to run.log until it closes; returns the
    last lines, taking in what the run tells (TELL lines)."""
    lines: list[str] = []
    log = None
    for raw in sys.stdin.buffer:
        text = raw.decode(errors="replace")
        if text.startswith(TELL):
            try:
                settings.update(json.loads(text[len(TELL):]))
            except ValueError:
                pass
            continue
        lines.append(text.rstrip("\n"))
        del lines[:-4000]  # the verdict is in the last lines
        try:
            log = log or open(settings["log"], "a")  # the folder exists by now
            log.write(text)
            log.flush()
        except OSError:
            pass
    return lines


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run decides when this ends
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    settings = json.loads(argv[0])
    lines = _read(settings)
    dead = verdict(lines, settings.get("process"))
    if dead is None:
        return 0
    message = line_for(dead, settings)
    survivors = sorted(set(range(settings.get("processes") or 1)) - set(dead))
    if survivors and settings.get("process") == survivors[0]:
        _mark_summary(settings, message[len("error: "):])
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
