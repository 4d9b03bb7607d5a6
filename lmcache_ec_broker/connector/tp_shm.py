"""The TP ranks of one host agree on a step's failed loads through shared memory.

Each rank of a TP group loads the step's items itself; one rank's load can fail
while another's succeeds (an entry evicted between their reads, one rank's
connection broken). Every rank must then encode the same items (the encoder runs
TP collectives), so they agree on the union of their failures (``tp_agree.py``).
When every rank of the group is on this host, they do it here, in a few
microseconds, instead of a gloo all-reduce (hundreds of microseconds).

The segment (one per TP group, created by the group's rank 0 with a random name,
``O_EXCL`` and mode 0600, opened by the others, unlinked once all have it open)::

    header   64 B   magic, nonce, world, ring, broken_from
    slots    world x 64 B, one cache line per rank: seq, done, failed bits
    ring     RING x 64 B, the decision of step seq at seq % RING: seq, abort, bits

Steps are numbered per group from 1: every rank calls ``agree`` exactly in the
steps with loads, and all ranks receive the same metadata, so rank r's k-th call
and rank q's k-th call are the same engine step.

Invariants (what makes disagreement impossible and every wait bounded):

1. **One decision per step, taken under the lock.** Every read-decide-write of the
   header, slots and ring happens while holding ``flock`` on the segment (the kernel
   frees it when a holder dies; the critical sections never wait). A step's outcome
   is the first decision written for it; every rank returns exactly that decision.
   Lock-free reads (the polling) are hints only: everything is re-read under the lock.
2. **A decision is either the union or "encode all".** The rank whose slot write
   completes the set (all ``world`` slots at step t) writes the union of their bits.
   A rank whose bounded wait expires first writes ``abort``: every rank re-encodes
   every load of the step — the same items on all ranks, so still consistent. A late
   rank finds the decision written and takes it without waiting.
3. **A rank passes step t only with t's decision in hand**; so a slot at seq t means
   that rank's decision for t-1 is known, and no rank's slot is ever past a step
   without a decision. ``done`` (per slot) is the last step whose decision the rank read.
4. **A ring entry is overwritten only when every rank has read it** (all ``done`` >=
   the entry's step). A union decision for t needs every rank at t (so done >= t-1).
   An abort writer checks ``done``; if some rank lags ``RING`` steps (a rank stuck for
   ``RING`` timeouts), it sets ``broken_from`` instead: from that step on every
   decision is abort, with no ring entry needed. (In vLLM a rank cannot run ahead
   more than a step: the model's own collectives wait for the others.)
5. **Every wait is bounded**: the poll ends at ``wait_s`` (then abort); the lock is
   held only for the few loads and stores above.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import struct
import time

SHM_DIR = "/dev/shm"
MAGIC = b"ECTPAGR1"
LINE = 64
RING = 64
BITS = (LINE - 16) * 8  # failed bits per slot and entry: item i -> bit min(i, BITS - 1)
NONCE_LEN = 16
WAIT_S = 2.0  # the bounded wait for the other ranks (a timeout only costs re-encodes)

_HEADER = struct.Struct(f"<8s{NONCE_LEN}sIIQ")  # magic, nonce, world, ring, broken_from
_BROKEN = struct.calcsize(f"<8s{NONCE_LEN}sII")  # offset of broken_from
_SEQ = struct.Struct("<Q")
_PAIR = struct.Struct("<QQ")  # slot: seq, done; entry: seq, abort
# The poll: spin (ranks on their own cores see each other within a microsecond), then
# yield the CPU, then sleep, doubling up to MAX_SLEEP_S, until the bound.
SPIN_S = 0.0002
YIELD_S = 0.002
MAX_SLEEP_S = 0.0005


def size_for(world: int) -> int:
    return LINE * (1 + world + RING)


def bits_of(n: int, failed_indices: set[int] | list[int]) -> int:
    """Item indices (0..n-1) as bits; items past BITS-1 share the last bit."""
    out = 0
    for i in failed_indices:
        out |= 1 << min(i, BITS - 1)
    return out


def indices_of(n: int, bits: int) -> set[int]:
    """The item indices the bits stand for (the last bit: every item from BITS-1 on)."""
    out = {i for i in range(min(n, BITS - 1)) if bits >> i & 1}
    if bits >> (BITS - 1) & 1:
        out.update(range(BITS - 1, n))
    return out


class SharedAgreement:
    """One rank's handle on its group's segment; ``agree`` is the per-step call."""

    def __init__(self, fd: int, rank: int, world: int, wait_s: float = WAIT_S) -> None:
        self._fd = fd
        self.rank = rank
        self.world = world
        self.wait_s = wait_s
        self._mm = mmap.mmap(fd, size_for(world))
        self._step = 0
        self.aborts = 0  # steps decided "encode all" (a counter, for logs and tests)

    # ------------------------------------------------------------ creation

    @staticmethod
    def create(world: int) -> tuple[int, str, bytes]:
        """Rank 0: a new segment; returns its fd, path and nonce."""
        nonce = secrets.token_bytes(NONCE_LEN)
        path = os.path.join(SHM_DIR, f"lmcache-ec-tp-{secrets.token_hex(12)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size_for(world))
            with mmap.mmap(fd, size_for(world)) as mm:
                _HEADER.pack_into(mm, 0, MAGIC, nonce, world, RING, 0)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return fd, path, nonce

    @staticmethod
    def open(path: str, nonce: bytes, world: int) -> int | None:
        """Another rank: the segment's fd, or None if this host does not have it
        (a rank on another host; a file of that name that is not it)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != size_for(world):
                raise ValueError
            head = os.pread(fd, _HEADER.size, 0)
            magic, got, w, ring, _ = _HEADER.unpack(head)
            if (magic, got, w, ring) != (MAGIC, nonce, world, RING):
                raise ValueError
        except (OSError, ValueError, struct.error):
            os.close(fd)
            return None
        return fd

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    # ------------------------------------------------------------ the step

    def agree(self, bits: int) -> int | None:
        """This rank's failed bits for the next step with loads -> the group's union,
        or None: "encode every load of the step" (a rank did not arrive within
        ``wait_s``). Every rank gets the same answer for the same step."""
        self._step += 1
        t = self._step
        fd = self._fd
        # The lock is taken and released inline (no context manager): this is the
        # engine step's critical path, and the whole call is a few microseconds.
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            decided = self._decided(t)
            if decided is _NONE:
                self._write_slot(t, bits)
                decided = self._union_if_all(t)  # sets done when it decides
            else:
                self._set_done(t)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        if decided is not _NONE:
            return self._count(decided)
        self._poll(t)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            decided = self._decided(t)
            if decided is _NONE:
                decided = self._abort(t)
            self._set_done(t)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return self._count(decided)

    # ------------------------------------------------------------ internals

    def _slot(self, rank: int) -> int:
        return LINE * (1 + rank)

    def _entry(self, t: int) -> int:
        return LINE * (1 + self.world + t % RING)

    def _decided(self, t: int) -> int | None | object:
        """Under the lock: t's decision (bits, or None for abort), else _NONE."""
        broken = _SEQ.unpack_from(self._mm, _BROKEN)[0]
        if broken and broken <= t:
            return None
        off = self._entry(t)
        seq, abort = _PAIR.unpack_from(self._mm, off)
        if seq != t:
            return _NONE  # (seq > t cannot be: invariant 4)
        return None if abort else int.from_bytes(self._mm[off + 16 : off + LINE], "little")

    def _write_slot(self, t: int, bits: int) -> None:
        off = self._slot(self.rank)
        self._mm[off + 16 : off + LINE] = bits.to_bytes(LINE - 16, "little")
        _SEQ.pack_into(self._mm, off, t)

    def _set_done(self, t: int) -> None:
        _SEQ.pack_into(self._mm, self._slot(self.rank) + 8, t)

    def _union_if_all(self, t: int) -> int | object:
        """Under the lock, with this rank's slot at t: if every slot is at t, write and
        return their union (this rank's ``done`` first, the entry last: a waiter that
        sees the entry finds the lock about to be free, never held for more work)."""
        mm = self._mm
        union = 0
        for q in range(self.world):
            off = LINE * (1 + q)
            if _SEQ.unpack_from(mm, off)[0] != t:
                return _NONE
            union |= int.from_bytes(mm[off + 16 : off + LINE], "little")
        self._set_done(t)
        self._write_entry(t, 0, union)  # every rank is at t: all done >= t-1 (inv. 4)
        return union

    def _abort(self, t: int) -> None:
        oldest = min(
            _PAIR.unpack_from(self._mm, self._slot(q))[1]
            for q in range(self.world)
            if q != self.rank
        )
        if oldest + RING >= t:
            self._write_entry(t, 1, 0)
        else:  # a rank lags RING steps: its entry cannot be overwritten (inv. 4)
            _SEQ.pack_into(self._mm, _BROKEN, t)
        return None

    def _write_entry(self, t: int, abort: int, bits: int) -> None:
        off = self._entry(t)
        self._mm[off + 16 : off + LINE] = bits.to_bytes(LINE - 16, "little")
        _PAIR.pack_into(self._mm, off, t, abort)

    def _poll(self, t: int) -> None:
        """Lock-free until t's entry shows (or the group broke) or wait_s passed."""
        mm, off = self._mm, self._entry(t)
        start = time.monotonic()
        deadline = start + self.wait_s
        sleep = 0.00002
        while True:
            if _SEQ.unpack_from(mm, off)[0] == t:
                return
            broken = _SEQ.unpack_from(mm, _BROKEN)[0]
            if broken and broken <= t:
                return
            now = time.monotonic()
            if now >= deadline:
                return
            if now - start < SPIN_S:
                continue
            if now - start < YIELD_S:
                os.sched_yield()
            else:
                time.sleep(min(sleep, deadline - now))
                sleep = min(sleep * 2, MAX_SLEEP_S)

    def _count(self, decided: int | None | object) -> int | None:
        if decided is None:
            self.aborts += 1
        assert decided is not _NONE
        return decided  # type: ignore[return-value]


_NONE = object()  # "no decision yet" (None means abort)
