"""The remote tier on Mooncake Store: the transport (client lifecycle, key listing,
deletes) -- the data path is ``data_path.py``, the rules are the remote policy's.

Enabled with ``remote_url: mooncakestore://<master host:port>`` (LMCache's scheme).
The broker's whole slab is registered with the Mooncake client once (in the
background: a master that is down at start only delays it).

The object is exactly the remote value format of ``../remote/value.py`` (header +
payload), so a value is untrusted input here as it is in Redis.

Mooncake semantics this transport relies on (0.3.13, docs/mooncake.md): ``put``
never overwrites (a refused value is removed before it is replaced); every read
grants the reader a lease (10 s) during which ``remove`` answers -706 (HAS_LEASE):
the delete is tried again after the lease (``Retry``); the objects live in the
segments the clients (brokers) contribute, so a broker that stops takes its
objects with it, and a master restart loses every object -- both cost only hits.
Mooncake has no announcements: the master's key list is polled every
``mooncake_key_poll_s`` (0: never; the filter is then partial) and every lookup asks the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from ....config_mooncake import SCHEME
from ....protocol import Extent
from ..base import EntryMeta, SlabAccess, TierError
from ..remote.connect_error import ConnectTrouble
from ..remote.policy import Limits
from ..remote.stats import REMOTE_COUNTERS
from ..remote.tier import Meter, RemoteTier
from ..remote.transport import LookupAnswer, Node, Outcome, Retry, StoreDown, WriteItem, owned
from ..remote.value import stored_key
from . import claims as fleet_claims
from .data_path import (
    BATCH_WRITE_BYTES,
    BATCH_WRITES,
    HAS_LEASE,
    LOOKUP_CHUNK,
    MASTER,
    NOT_FOUND,
    RPC_FAIL,
    STAGE_BYTES,
    STAGES,
    Fetched,
    MooncakeIO,
    Slots,
)
from .settings import EXTRA_HINT, MooncakeSettings

__all__ = ["MooncakeSettings", "MooncakeTier", "MooncakeTransport"]

log = logging.getLogger("lmcache_ec_broker.mooncake")

_CLOSE_WAIT_S = 5.0
_LEASE_RETRY_S = 2.0
LOOKUP_THREADS = 4

# The same stats names as the Redis backend (tests/test_remote_mooncake.py checks it).
COUNTERS = REMOTE_COUNTERS


def import_store_class() -> Any:
    """Mooncake's client class, or TierError naming the extra to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise TierError(
            f"remote_url {SCHEME}:// needs the Mooncake client, which is not installed "
            f"({exc}); install it with: {EXTRA_HINT}"
        ) from None
    return MooncakeDistributedStore


class MooncakeTransport:
    write_batch = BATCH_WRITES
    write_workers = 1  # one writer: a batch at a time, as Mooncake likes it
    fetches = True  # a get no lookup preceded reads the value at once (``fetch_staged``)

    def __init__(self, settings: MooncakeSettings, meter: Meter) -> None:
        self.s = settings
        self.meter = meter
        self.poll_s = settings.key_poll_s
        self._store: Any = None
        self._store_cls: Any = None
        self._slots: Slots | None = None
        self._stages: Slots | None = None
        self._io: MooncakeIO | None = None
        self._slab: SlabAccess | None = None
        self._connected = threading.Event()
        self._stopping = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.trouble = ConnectTrouble(f"Mooncake master {settings.master}")  # stats, log once

    def describe(self) -> str:
        return (
            f"Mooncake master {self.s.master} ({self.s.protocol}), key prefix {self.s.key_prefix!r}"
        )

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        self._store_cls = import_store_class()
        if self.s.protocol not in ("tcp", "rdma"):
            raise TierError(f"mooncake_protocol must be tcp or rdma, got {self.s.protocol!r}")
        if self.s.protocol == "rdma" and not self.s.device_name:
            raise TierError("mooncake_protocol rdma needs mooncake_device_name (e.g. mlx5_0)")
        # Mooncake reads these at setup; bound its own waits by ours unless the operator chose.
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(int(self.s.timeout_s * 1000), 100)))
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(int(self.s.timeout_s * 4), 2)))
        # One attempt per setup call (its retries hold the GIL); _connect_loop retries.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        # a write batch, every lookup thread's chunk (and a clear's), reads one each
        self._slots = Slots(BATCH_WRITES + (LOOKUP_THREADS + 1) * LOOKUP_CHUNK + 64)
        self._stages = Slots(STAGES, STAGE_BYTES)
        self._io = MooncakeIO(self.s, self._slots, self.meter, self._stages)

    def start(self, slab: SlabAccess) -> None:
        self._slab = slab
        self._thread = threading.Thread(
            target=self._connect_loop, name="ecb-mooncake-connect", daemon=True
        )
        self._thread.start()

    def ready(self) -> bool:
        return self._connected.is_set()

    def _connect_loop(self) -> None:
        """Set up the client and register the slab once; the tier is down until then."""
        backoff = 0.5
        while not self._stopping.is_set():
            store = None
            try:
                # Mooncake's setup holds the GIL while it waits for the master (measured:
                # 4.5 s per attempt, the broker's event loop frozen meanwhile): call it
                # only once the master's port answers a plain connect, which does not.
                self._probe_master()
                store = self._store_cls()
                rc = store.setup(
                    self.s.local_hostname,
                    self.s.metadata_server,
                    self.s.global_segment_size,
                    self.s.local_buffer_size,
                    self.s.protocol,
                    self.s.device_name,
                    self.s.master,
                )
                if rc != 0:
                    raise RuntimeError(f"setup returned {rc}")
                assert self._slab is not None and self._slots is not None
                assert self._stages is not None
                for addr, size in (
                    (self._slab.address, self._slab.size),
                    (self._slots.address, self._slots.size),
                    (self._stages.address, self._stages.size),
                ):
                    rc = store.register_buffer(addr, size)
                    if rc != 0:
                        raise RuntimeError(f"register_buffer returned {rc}")
            except Exception as exc:  # noqa: BLE001 - any failure here means "still down"
                self.trouble.failed(exc)  # the cause, once (and in stats)
                log.debug(
                    "Mooncake master %s not reachable (%s); retrying in %.1fs",
                    self.s.master,
                    exc,
                    backoff,
                )
                if store is not None:
                    with contextlib.suppress(Exception):
                        store.close()
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            self._store = store
            self.trouble.ok()
            self._connected.set()
            log.info("Mooncake remote tier connected to %s (%s)", self.s.master, self.s.protocol)
            return

    def _probe_master(self) -> None:
        host, _, port = self.s.master.rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=self.s.timeout_s):
            pass

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        store, self._store = self._store, None
        self._connected.clear()
        if self._io is not None:
            self._io.close()
        if store is None:
            return

        def release() -> None:
            try:
                if self._slab is not None:
                    store.unregister_buffer(self._slab.address)
                for own in (self._slots, self._stages):
                    if own is not None:
                        store.unregister_buffer(own.address)
                store.close()  # unmounts this broker's segment: its objects leave the store
            except Exception as exc:  # noqa: BLE001
                log.warning("Mooncake client close: %s", exc)

        # With the master down Mooncake retries its unmount RPC for a long time:
        # bounded here, the process exits without waiting for it.
        t = threading.Thread(target=release, name="ecb-mooncake-close", daemon=True)
        t.start()
        t.join(_CLOSE_WAIT_S)
        if t.is_alive():
            log.warning("Mooncake client did not close within %.0fs (master down?)", _CLOSE_WAIT_S)

    # ------------------------------------------------------------ calls

    def _client(self) -> tuple[Any, MooncakeIO]:
        store, io = self._store, self._io
        if store is None or io is None or not self._connected.is_set():
            # not the store's verdict (no client yet): no breaker failure; remote_up is 0
            raise Retry(0.5, f"Mooncake master {self.s.master} not connected yet")
        return store, io

    def node_of(self, key: str) -> Node:
        return MASTER

    def nodes(self) -> list[Node]:
        return [MASTER]

    def lookup(self, keys: list[str]) -> list[LookupAnswer]:
        store, io = self._client()
        return io.lookup(store, keys, self._slab)

    def read_into(self, key: str, meta: EntryMeta, extents: list[Extent], slab: SlabAccess) -> None:
        store, io = self._client()
        io.read_into(store, key, meta, list(extents), slab)

    # A get no lookup preceded (``RemoteTier.fetch``): take_stage on the loop, then
    # fetch_staged on a read thread, then unstage on the loop once the range is reserved,
    # then give_stage -- the stage belongs to that one fetch until then.

    def take_stage(self) -> int | None:
        """A staging buffer, or None when all are in use (the caller looks up instead)."""
        if self._stages is None or not self._connected.is_set():
            return None
        return self._stages.try_take()

    def give_stage(self, stage: int) -> None:
        assert self._stages is not None
        self._stages.give([stage])

    def fetch_staged(self, key: str, stage: int) -> Fetched:
        store, io = self._client()
        return io.fetch(store, key, stage, self._slab)

    def unstage(self, stage: int, fetched: Fetched, extents: list[Extent]) -> None:
        assert self._io is not None and self._slab is not None
        self._io.unstage(stage, fetched, extents, self._slab)

    def write(self, items: Sequence[WriteItem], slab: SlabAccess) -> list[Outcome]:
        store, io = self._client()
        return io.write(store, items, slab)

    def delete(self, key: str) -> None:
        store, io = self._client()
        rc = int(store.remove(io.mkey(key), False))
        if rc == HAS_LEASE:
            # Someone read it within the lease TTL: the master keeps it until the lease
            # ends. The policy answers misses for it meanwhile and tries again.
            self.meter.count("remote_lease_conflicts")
            raise Retry(_LEASE_RETRY_S, f"{key!r} is leased by a reader")
        if rc == RPC_FAIL:
            raise StoreDown([MASTER], f"Mooncake master {self.s.master} RPC failed")
        if rc not in (0, NOT_FOUND):
            log.warning("Mooncake remove of %r failed: %d", key[:200], rc)

    def clear(self) -> int:
        """Remove the namespace's values -- only those whose header names the key
        they are listed under: a nested prefix's values stay."""
        store, io = self._client()
        names = self.list_keys(1 << 62)
        removed = 0
        for lo in range(0, len(names), LOOKUP_CHUNK):
            chunk = names[lo : lo + LOOKUP_CHUNK]
            heads = io.read_headers(store, chunk)
            for name, head in zip(chunk, heads, strict=True):
                if isinstance(head, int) and head == NOT_FOUND:
                    continue
                if isinstance(head, bytes) and not owned(stored_key(head), name):
                    continue  # another namespace nested inside ours
                rc = int(store.remove(io.mkey(name), True))
                if rc == RPC_FAIL:
                    raise StoreDown([MASTER], f"Mooncake master {self.s.master} RPC failed")
                removed += rc == 0
        log.info("Mooncake clear of prefix %r: %d removed", self.s.key_prefix, removed)
        return removed

    def list_keys(self, limit: int) -> list[str]:
        """The master's key list (its admin HTTP port), this namespace's keys only."""
        host = self.s.master.rpartition(":")[0]
        url = f"http://{host}:{self.s.admin_port}/get_all_keys"
        try:
            with urllib.request.urlopen(url, timeout=self.s.timeout_s) as resp:
                body = resp.read(256 << 20)
        except Exception as exc:  # noqa: BLE001 - the admin port is the master's
            raise StoreDown([MASTER], f"Mooncake key listing failed: {exc}") from None
        prefix = self.s.key_prefix
        out = []
        for line in body.decode("utf-8", "replace").split("\n"):
            if line.startswith(prefix) and len(line) > len(prefix):
                out.append(line[len(prefix) :])
                if len(out) >= limit:
                    break
        return out

    def probe(self, node: Node) -> None:
        store, io = self._client()
        try:
            rc = int(store.is_exist(io.mkey("\0probe")))
        except Exception as exc:  # noqa: BLE001
            raise StoreDown([MASTER], str(exc)) from None
        if rc not in (0, 1):
            raise StoreDown([MASTER], f"Mooncake master {self.s.master} answered {rc}")

    def start_announcements(
        self,
        on_keys: Callable[[list[str]], None],
        on_resync: Callable[[], None],
        on_health: Callable[[Node, bool], None],
    ) -> None:
        """Mooncake has no announcements: the key list is polled (``poll_s``)."""
        return None

    # ------------------------------------------------------------ fleet claims

    def claim_keys(self, owner: bytes, keys: list[str], ttl_ms: int) -> list[bool | None]:
        """In-flight deduplication across brokers (mooncake/claims.py): per key True
        (ours), False (another broker's, or the value is in the store already: our claim
        is given back), None (unknown). Raises StoreDown / Retry."""
        store, io = self._client()
        out: list[bool | None] = []
        for key in keys:
            mkey = io.mkey(key)
            won = fleet_claims.claim(store, mkey, owner, ttl_ms)
            if won and fleet_claims.value_exists(store, mkey):
                fleet_claims.unclaim(store, [mkey], owner)
                won = False
            out.append(won)
        return out

    def claimed_by_others(self, owner: bytes, keys: list[str]) -> list[bool]:
        """Per key: another broker's claim, or the value itself in the store (its
        encoder wrote it, then gave its claim back, since the caller's lookup: look
        again instead of encoding it twice; as redis/claims.py held_by_others)."""
        store, io = self._client()
        out: list[bool] = []
        for key in keys:
            mkey = io.mkey(key)
            out.append(
                fleet_claims.held_by_others(store, mkey, owner)
                or fleet_claims.value_exists(store, mkey)
            )
        return out

    def unclaim_keys(self, owner: bytes, keys: list[str]) -> None:
        store, io = self._client()
        fleet_claims.unclaim(store, [io.mkey(k) for k in keys], owner)


class MooncakeTier(RemoteTier):
    """The remote policy over Mooncake Store."""

    counter_names = COUNTERS

    def __init__(self, settings: MooncakeSettings, max_pending_bytes: int = 0) -> None:
        meter = Meter(COUNTERS)
        transport = MooncakeTransport(settings, meter)
        self.s = settings
        limits = Limits(
            timeout_s=settings.timeout_s,
            write_queue=settings.write_queue,
            # 0: a quarter of the slab, set at start (the slab's size is known then)
            max_pending_bytes=max_pending_bytes or (1 << 62),
            max_entry_bytes=settings.max_entry_size or (1 << 62),
            filter_cap=settings.max_reported_keys,
            announces=False,
            discovers=settings.key_poll_s > 0,
            lookup_concurrency=LOOKUP_THREADS,
            write_workers=MooncakeTransport.write_workers,
            write_batch=MooncakeTransport.write_batch,
            write_batch_bytes=BATCH_WRITE_BYTES,
        )
        self._budget_from_slab = max_pending_bytes == 0
        super().__init__(transport, limits, meter, transport.describe())

    def start(self, loop: Any, slab: SlabAccess, events: Any) -> None:
        if self._budget_from_slab or not self.s.max_entry_size:
            import msgspec

            changes: dict[str, int] = {}
            if self._budget_from_slab:
                changes["max_pending_bytes"] = max(slab.size // 4, 1)
            if not self.s.max_entry_size:
                changes["max_entry_bytes"] = slab.size
            self.limits = msgspec.structs.replace(self.limits, **changes)
            self.policy.limits = self.limits
        super().start(loop, slab, events)

    @property
    def _store(self) -> Any:  # tests poison values through the tier's own client
        return self.transport._store  # type: ignore[attr-defined]
