"""What an executor needs besides the cells, derived from a schedule table and checked:
which buffer slot every message and stash entry uses, and which point-to-point sends
each tick makes.

Messages. F(i, g) sends its output to F(i, g+1) (buffer `act`); the last stage's F sends
dL/dy to its own backward (buffer `grad`, locally); B or BW(i, g) sends dx to the backward
of (i, g-1) (`grad`). A message is stored at the end of the tick that produced it, on the
rank that consumes it, and read during the consumer's tick.

Stash. F(i, g) keeps what its backward needs until its last backward cell: the VJP
residuals for BW; for a split backward, the residuals of B and the weight matmuls'
inputs, and then (written by B over the dead residuals) the matmul output gradients W
needs.

Slots. Per rank and buffer, entries are intervals [written, read]; a slot is reused as
soon as its last entry was read (interval colouring, lowest free slot first, which is
optimal for intervals). Every rank allocates the largest count (one SPMD program).

Sends. A message from rank s to rank d travels on channel (buffer, (d - s) mod p): on a
tick, the ranks sending on one channel form a permutation (each rank sends at most one
message per buffer per tick), so one `ppermute` with exactly those pairs moves them, and
idle ranks send nothing. Shift 0 is a rank's message to itself (no communication).
Overlapped sends (`Schedule.overlap`): a message to another rank travels during the
tick after the one that made it and is stored at that tick's end. Its channel sends
unconditionally, with every pair it ever uses (a `ppermute` inside a branch could not
overlap the cell's compute), in the ticks of the pair (forward or backward, `phases`)
in which it carries messages; senders without a message send zeros, which cost bytes
but no time while they overlap a cell.
`check` re-verifies all of this by replaying the table tick by tick.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from framework.parallel.pipeline.kinds import (ACT, GRAD, KINDS, STASH, F, backward_units,
                                               needs, stored_at)
from framework.parallel.pipeline.table import AUTODIFF, Schedule


@dataclass(frozen=True)
class Message:
    buffer: str  # ACT or GRAD
    microbatch: int
    src: int  # ranks
    dst: int
    sent: int  # tick whose cell makes it
    used: int  # tick that reads it
    stored: int  # tick at whose end it is stored: `sent`, or one later if it overlaps


@dataclass(frozen=True, eq=False)
class Channel:
    buffer: str
    shift: int  # dst = (src + shift) % p; 0: to itself
    arrive: np.ndarray  # [ticks, ranks] slot the rank stores into after the tick (-1: none)
    pattern: np.ndarray  # [ticks] index into `pairs`; 0 = nobody sends
    pairs: tuple  # pairs[k]: ((src, dst), ...) of pattern k; pairs[0] == ()
    # Overlapped: pairs == ((), every pair), sent at the start of each tick of `phases`
    # (0: forward, 1: backward tick of a pair) the previous tick's messages.
    overlap: bool = False
    phases: tuple = ()


@dataclass(frozen=True, eq=False)
class Buffers:
    n_slots: dict  # {"stash", "act", "grad"} -> slots per rank
    stash: np.ndarray  # [ticks, ranks] the cell's microbatch's stash slot (-1: none):
    #                    F writes it, B (split) reads and rewrites it, W or BW reads it
    read: np.ndarray  # [ticks, ranks] F: its input's `act` slot (-1: the embedding);
    #                   B, BW: its dy's `grad` slot
    channels: tuple  # Channel, ...
    messages: tuple  # Message, ... (for checks and accounting)


def messages(s: Schedule) -> list[Message]:
    """Every message the table implies: per unit of work the executor runs, what it
    needs through ACT or GRAD (`table.needs`), from the cell that made it (autodiff
    tables: the forward rows' activations only), stored when `stored_at` says."""
    rows = s.forward_rows()
    at, S = rows.cells(), s.n_global_stages
    out = []
    for (kind, i, g), (t, r) in sorted(at.items(), key=lambda kv: kv[1]):
        for need in needs(kind, i, g, S, s.parts):
            for buffer in set(need.via) & {ACT, GRAD}:
                if need.work in at:  # (autodiff: the last stage's dL/dy is not a cell's)
                    t0, r0 = at[need.work]
                    stored = stored_at(t0, r0, r, s.overlap)
                    out.append(Message(buffer, i, r0, r, t0, t, stored))
    return sorted(out, key=lambda msg: (msg.sent, msg.src, msg.buffer))


def _colour(intervals: list[tuple[int, int, tuple]]) -> tuple[dict, int]:
    """intervals (start, end, key), per rank: slot per key such that an entry's slot
    is reused only from its end on. Returns ({key: slot}, slots used)."""
    free_at: list[int] = []  # per slot: the tick from which it is free
    slot = {}
    for start, end, key in sorted(intervals):
        for k, t in enumerate(free_at):
            if t <= start:
                free_at[k] = end
                slot[key] = k
                break
        else:
            slot[key] = len(free_at)
            free_at.append(end)
    return slot, len(free_at)


@lru_cache(maxsize=None)
def _plan(s: Schedule, combined: bool = False) -> Buffers:
    p, T = s.n_stages, s.n_ticks
    rows = s.forward_rows()
    T = rows.n_ticks
    msgs = messages(s)
    at = rows.cells()
    read = np.full((T, p), -1, np.int32)
    n_slots = {}
    slot_of: dict[Message, int] = {}
    to: dict[tuple, list] = {}  # (buffer, receiving rank) -> its messages
    for m in msgs:
        to.setdefault((m.buffer, m.dst), []).append((m.stored, m.used, m))
    for buf in (ACT, GRAD):
        n_slots[buf] = 0
        for r in range(p):
            slots, n = _colour(to.get((buf, r), []))
            slot_of.update(slots)
            n_slots[buf] = max(n_slots[buf], n)
    for m in msgs:
        read[m.used, m.dst] = slot_of[m]
    # A microbatch's stash slot lives from its F to the last cell that reads it (W, BW
    # or BW0; `stash_users`): with a split backward
    # B reuses it for the matmul output gradients W needs (the residuals are dead then).
    # Combined (`Program.fused`): a BW's slot stays live through the next tick, whose F
    # runs beside it writing its own slot as the BW reads its.
    stash = np.full((T, p), -1, np.int32)
    held = 2 if combined else 0
    n_slots["stash"] = 0
    if s.executor != AUTODIFF:
        for r in range(p):
            users = stash_users(rows, at, r)  # (i, g) -> ticks of the cells that use it
            slots, n = _colour([(min(ts), max(ts) + held, key) for key, ts in users.items()])
            n_slots["stash"] = max(n_slots["stash"], n)
            for (i, g), k in slots.items():
                for kind in {F, *backward_units(rows.parts)}:
                    if (kind, i, g) in at:
                        stash[at[kind, i, g]] = k
    on: dict[tuple, list] = {}  # (buffer, shift) -> its messages
    for m in msgs:
        on.setdefault((m.buffer, (m.dst - m.src) % p), []).append(m)
    channels = [_channel(buf, shift, on[buf, shift], slot_of, T, p, s.overlap and shift != 0,
                         s.ticks_per_step)
                for buf in (ACT, GRAD) for shift in range(p) if (buf, shift) in on]
    return Buffers(n_slots, stash, read, tuple(channels), tuple(msgs))


def stash_users(s: Schedule, at: dict, r: int) -> dict:
    """On rank r: (microbatch, stage) -> the ticks of its F and of every cell that reads
    what F stashed (a STASH need of the rule, directly or through B's rewrite for W)."""
    users: dict = {}
    for (kind, i, g), (t, rr) in at.items():
        if rr == r and (kind == F or any(STASH in need.via for need in
                                         needs(kind, i, g, s.n_global_stages, s.parts))):
            users.setdefault((i, g), []).append(t)
    return users


def _channel(buf: str, shift: int, mine: list, slot_of: dict, T: int, p: int,
             overlap: bool, k: int) -> Channel:
    """The channel (buf, shift) carrying the messages `mine`: where each arrives, and
    which ranks send in each tick (a pattern; overlapped: every pair, every tick of its
    phases)."""
    arrive = np.full((T, p), -1, np.int32)
    senders: dict[int, set] = {}
    for m in mine:
        arrive[m.stored, m.dst] = slot_of[m]
        senders.setdefault(m.stored, set()).add(m.src)
    if overlap:
        phases = tuple(sorted({t % k for t in senders}))
        every = tuple(sorted((src, (src + shift) % p) for src in {m.src for m in mine}))
        pattern = np.isin(np.arange(T) % k, phases).astype(np.int32)
        return Channel(buf, shift, arrive, pattern, ((), every), True, phases)
    patterns = [()]
    pattern = np.zeros(T, np.int32)
    for t, srcs in sorted(senders.items()):
        pairs = tuple((src, (src + shift) % p) for src in sorted(srcs))
        if pairs not in patterns:
            patterns.append(pairs)
        pattern[t] = patterns.index(pairs)
    return Channel(buf, shift, arrive, pattern, tuple(patterns))


def sends_per_step(s: Schedule, combined: bool = False) -> int:
    """Messages put on the wire between ranks per step, all ranks together: the
    table's, and with overlapped sends every pair of every tick of a channel's phases
    (the zeros of senders without a message included; `combined`, whose loop runs the
    first and last ticks apart: but in the first, when nothing was made yet, and the
    last, whose messages nobody reads). Without building the plan."""
    between = [m for m in messages(s) if m.src != m.dst]
    if not s.overlap:
        return len(between)
    channels: dict[tuple, tuple[set, set]] = {}
    for m in between:
        srcs, phases = channels.setdefault((m.buffer, (m.dst - m.src) % s.n_stages),
                                           (set(), set()))
        srcs.add(m.src)
        phases.add(m.stored % s.ticks_per_step)
    k = s.ticks_per_step
    ends = (0, (s.n_ticks - 1) % k) if combined else ()
    return sum(len(srcs) * sum((s.n_ticks + k - 1 - ph) // k - ends.count(ph) for ph in phases)
               for srcs, phases in channels.values())


def plan(s: Schedule, combined: bool = False) -> Buffers:
    """The checked buffer plan of a schedule (cached per schedule), run combined or not
    (`parallel.combined_1f1b`)."""
    buffers = _plan(s, combined)
    check(s, buffers, combined)
    return buffers


def check(s: Schedule, buffers: Buffers, combined: bool = False) -> None:
    """Replays the table and raises ValueError unless: every microbatch passes every
    stage once forward and once backward (B + W, or BW) on the rank that holds the
    stage; every cell runs after what it depends on (messages one tick later); and no
    buffer slot is overwritten while its entry is still to be read (`combined`: an F
    writes its slot from the start of the tick before its own, where a BW it may run
    beside reads)."""
    rows = s.forward_rows()
    at = rows.cells()
    S, m = s.n_global_stages, s.n_microbatches
    kinds = (F,) if s.executor == AUTODIFF else (F, *backward_units(s.parts))
    for i in range(m):
        for g in range(S):
            for kind in kinds:
                name = f"{KINDS[kind].name}({i}, stage {g})"
                if (kind, i, g) not in at:
                    raise ValueError(f"schedule {s.name}: {name} is missing")
                if at[kind, i, g][1] != s.stages.rank[g]:
                    raise ValueError(f"schedule {s.name}: {name} on the wrong rank")
    for (kind, i, g), cell in at.items():
        for need in needs(kind, i, g, S, s.parts):
            t0 = at.get(need.work, (-1,))[0]  # (autodiff: the backward is not in the rows)
            if t0 > cell[0] or (t0 == cell[0] and at[need.work] != cell):  # (a BW's own B)
                k, j, h = need.work
                raise ValueError(f"schedule {s.name}: {KINDS[kind].name}({i}, stage {g}) at "
                                 f"tick {cell[0]} runs before {KINDS[k].name}({j}, stage {h})")
    # Slots: replay stores (end of tick) and reads (during the tick) per rank and buffer.
    live: dict[tuple, object] = {}  # (buffer, rank, slot) -> what it holds
    events = []  # (tick, order, action, key, content): reads (0) before stores (1)
    for msg in buffers.messages:
        k = buffers.read[msg.used, msg.dst]
        if msg.used <= msg.stored:
            raise ValueError(f"schedule {s.name}: tick {msg.used} reads a {msg.buffer} "
                             f"message that arrives at the end of tick {msg.stored}")
        events += [(msg.stored, 1, "store", (msg.buffer, msg.dst, k), msg),
                   (msg.used, 0, "read", (msg.buffer, msg.dst, k), msg)]
    for r in range(s.n_stages) if s.executor != AUTODIFF else ():
        for (i, g), ticks in stash_users(rows, at, r).items():
            if len({int(buffers.stash[t, r]) for t in ticks}) != 1:
                raise ValueError(f"schedule {s.name}: the cells of microbatch {i}, stage {g} "
                                 f"use different stash slots")
            slot = int(buffers.stash[ticks[0], r])
            start = (min(ticks) - 1, -1) if combined else (min(ticks), 1)
            events += [(*start, "store", ("stash", r, slot), (i, g)),
                       (max(ticks), 0, "read", ("stash", r, slot), (i, g))]
    for t, _, action, key, content in sorted(events, key=lambda e: e[:2]):
        if action == "store":
            if key in live:
                raise ValueError(f"schedule {s.name}: tick {t} overwrites {key[0]} slot "
                                 f"{key[2]} of rank {key[1]} while it is live")
            live[key] = content
        else:
            if live.get(key) != content:
                raise ValueError(f"schedule {s.name}: tick {t} reads {key[0]} slot {key[2]} "
                                 f"of rank {key[1]}, which does not hold its entry")
            del live[key]
