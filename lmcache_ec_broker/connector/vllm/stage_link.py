"""The staging link between a vLLM engine's scheduler connector and its workers.

A hit is staged before it is scheduled (docs/design.md, "Staged loads"): the
scheduler's lookup sends a *stage order*; every worker that runs the encoder (the
TP ranks of the first pipeline stage) copies the entry from the broker onto its
device, holds the tensor, and reports it staged; ``ensure_cache_available`` holds
the request until every such rank has, and ``start_load_caches`` then only moves
the held tensor into vLLM's encoder cache.

Why a link of its own and not vLLM's step hooks alone: the V1 model runner calls
no EC hook in a step that schedules no tokens (``GPUModelRunner.execute_model``
returns before ``maybe_get_ec_connector_output``; only the V2 runner has
``ActiveECConnector.no_forward``), which is exactly the step in which a held
request waits when nothing else runs; and with pipeline parallelism the V1 runner
drops the first stage's ``ec_connector_output``. Orders sent with the step's
metadata would reach a V1 worker only when some other request runs, and its
reports never with PP > 1. So orders and reports travel here, at any moment,
whatever the runner and the executor; the step's metadata still carries the loads
(``start_load_caches``), which always run in a step that schedules their request.

Transport: one Unix SOCK_SEQPACKET socket, bound by the scheduler's connector
(``StageHub``) in the per-user private directory (mode 0700) under a name both
sides derive from the engine's ``VllmConfig`` (``instance_id``, which the workers
receive with the config, and the data-parallel rank); every worker's connector
(``StageLink``) connects from a background thread, retrying until the hub is up,
and says which TP rank it is. Messages are msgspec-msgpack Structs (no pickle).

Invariants:

1. **A rank reports an item staged only while it holds its tensor** (checked
   against the order's dtype, shape and model field by ``fetch``). It holds one
   count per order: ``start_load_caches`` taking the tensor for a shipped load
   ends one, ``StageRelease`` ends one; the tensor goes with the last. The hub ends each
   order exactly once (stage_book.py), so a shipped load always finds its tensor.
2. **Every wait is bounded**: a rank that does not report within the hold bound
   fails the item (the request encodes it); the hub then counts that rank as
   late and orders nothing more (misses: encodes) until it answers again, so a
   hung worker or broker costs one bounded wait per outage, not one per item.
3. **No link, no staging**: until every encoder rank has connected, or after one's
   link broke, lookups stage nothing (misses) — never a wait without a bound.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from lmcache_ec_broker.private_dirs import check_private_dir, private_socket_dir

MAX_MSG = 1 << 20  # a SEQPACKET message: orders of a few thousand items
CONNECT_RETRY_S = 0.05  # a worker retries connecting to a hub not up yet


class StageItem(msgspec.Struct, frozen=True):
    mm_hash: str
    key: str  # the broker key (model field included)
    num_embeds: int
    width: int | None = None


class LinkHello(msgspec.Struct, tag=True):
    rank: int  # the worker's TP rank


class Stage(msgspec.Struct, tag=True):
    items: list[StageItem]


class StageRelease(msgspec.Struct, tag=True):
    hashes: list[str]


class Staged(msgspec.Struct, tag=True):
    rank: int
    ok: list[str]
    failed: list[str]


Message = LinkHello | Stage | StageRelease | Staged
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def link_path(vllm_config: Any) -> str:
    """The hub's socket path for this engine (scheduler and workers derive the same)."""
    instance = str(getattr(vllm_config, "instance_id", "") or "default")
    parallel = getattr(vllm_config, "parallel_config", None)
    dp = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance)[:40]
    return os.path.join(private_socket_dir(), f"stage-{safe}-dp{dp}.sock")


def encoder_ranks(vllm_config: Any) -> int:
    """How many workers run the encoder: the TP ranks of the first PP stage."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def loads_off_reason(vllm_config: Any) -> str:
    """Why this configuration must never stage a load; "" if it may."""
    parallel = getattr(vllm_config, "parallel_config", None)
    backend = getattr(parallel, "distributed_executor_backend", None)
    ranks = int(getattr(parallel, "tensor_parallel_size", 1) or 1) * int(
        getattr(parallel, "pipeline_parallel_size", 1) or 1
    )
    if backend == "external_launcher" and ranks > 1:
        return (
            "external_launcher runs one scheduler per rank: their lookups could disagree "
            "on which items to encode"
        )
    return ""


def _private_dir() -> str:
    path = private_socket_dir()
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_private_dir(path)
    return path


class StageHub:
    """The scheduler's end: a listening socket and one connection per encoder rank.
    Owned by the scheduler's connector, used from its thread only (no locks)."""

    def __init__(self, path: str, ranks: int) -> None:
        _private_dir()
        self.path = path
        self.ranks = ranks
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead engine's socket (instance ids are per start)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(path)
        os.chmod(path, 0o600)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._pending: list[socket.socket] = []  # accepted, no LinkHello yet
        self._links: dict[int, socket.socket] = {}  # rank -> connection

    @property
    def up(self) -> bool:
        """Every encoder rank is connected."""
        return len(self._links) == self.ranks

    def send(self, message: Stage | StageRelease) -> bool:
        """To every rank; False if some link is broken (then dropped)."""
        data = _encoder.encode(message)
        ok = True
        for rank, conn in list(self._links.items()):
            try:
                conn.send(data)
            except OSError:
                self._drop(rank)
                ok = False
        return ok

    def poll(self) -> list[Staged]:
        """Accept new workers and read every report waiting; never blocks."""
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, OSError):
                break
            conn.setblocking(False)
            self._pending.append(conn)
        reports: list[Staged] = []
        for conn in list(self._pending):
            for msg in self._read(conn):
                if isinstance(msg, LinkHello):
                    self._pending.remove(conn)
                    old = self._links.pop(msg.rank, None)
                    if old is not None:
                        old.close()
                    self._links[msg.rank] = conn
                    break
        for rank, conn in list(self._links.items()):
            for msg in self._read(conn, rank):
                if isinstance(msg, Staged):
                    reports.append(msg)
        return reports

    def wait(self, timeout_s: float) -> None:
        """Block until a worker wrote or connected, at most ``timeout_s`` (tests)."""
        import select

        select.select([self._listener, *self._pending, *self._links.values()], [], [], timeout_s)

    def _read(self, conn: socket.socket, rank: int | None = None) -> list[Any]:
        out = []
        while True:
            try:
                data = conn.recv(MAX_MSG)
            except BlockingIOError:
                return out
            except OSError:
                data = b""
            if not data:  # closed
                if rank is not None:
                    self._drop(rank)
                elif conn in self._pending:
                    self._pending.remove(conn)
                    conn.close()
                return out
            try:
                out.append(_decoder.decode(data))
            except msgspec.DecodeError:
                continue  # not ours: ignored

    def _drop(self, rank: int) -> None:
        conn = self._links.pop(rank, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for conn in [*self._pending, *self._links.values()]:
            conn.close()
        self._pending.clear()
        self._links.clear()
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class StageLink:
    """A worker's end: a background thread that connects to the hub, stages what it
    is ordered to (``fetch``), and holds the tensors until ``take`` or ``StageRelease``.

    ``fetch(items)`` returns, per item, the tensor on this worker's device or the
    reason it could not be had (any exception is caught: a failure, never a crash).
    ``prepare()``, if given, runs on the thread once before it links (what the first
    fetch would otherwise pay: its broker connection and slab mapping); it may fail."""

    def __init__(
        self,
        path: str,
        rank: int,
        fetch: Callable[[list[StageItem]], list[torch.Tensor | str]],
        prepare: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self.rank = rank
        self._fetch = fetch
        self._prepare = prepare
        self._lock = threading.Lock()
        # mm_hash -> [tensor on the device, orders not ended yet] (invariant 1)
        self._staged: dict[str, list[Any]] = {}
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="ec-stage-link", daemon=True)
        self._thread.start()

    def take(self, mm_hash: str) -> torch.Tensor | None:
        """The staged tensor of ``mm_hash``, now the caller's (the link forgets it).

        A CUDA tensor is recorded on the caller's current stream: the link's thread
        allocated it on that thread's current stream (the default one), while vLLM
        reads it on its own (vllm.utils.current_stream). Without the record, once vLLM
        drops it from its encoder cache the allocator hands the block to the link's
        next get at once -- whose copy waits for the default stream only -- while a
        kernel of vLLM's stream that reads the old entry may still be queued (async
        scheduling frees entries while the device may still run the step that reads
        them): wrong embeddings."""
        with self._lock:
            tensor = self._end(mm_hash)
        if tensor is not None and tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
        return tensor

    def _end(self, mm_hash: str) -> torch.Tensor | None:
        held = self._staged.get(mm_hash)
        if held is None:
            return None
        held[1] -= 1
        if held[1] <= 0:
            del self._staged[mm_hash]
        return held[0]

    def held(self) -> set[str]:
        with self._lock:
            return set(self._staged)

    def _run(self) -> None:
        if self._prepare is not None:
            with contextlib.suppress(Exception):  # an outage: the first fetch connects
                self._prepare()
        while not self._closed.is_set():
            sock = self._connect()
            if sock is None:
                return
            try:
                self._serve(sock)
            except OSError:
                pass
            finally:
                sock.close()
                with self._lock:  # a new hub (engine restart) orders afresh
                    self._staged.clear()

    def _connect(self) -> socket.socket | None:
        while not self._closed.is_set():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(self.path)
                sock.send(_encoder.encode(LinkHello(self.rank)))
            except OSError:
                sock.close()
                self._closed.wait(CONNECT_RETRY_S)
                continue
            sock.settimeout(0.5)  # to notice close()
            self._sock = sock
            return sock
        return None

    def _serve(self, sock: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                data = sock.recv(MAX_MSG)
            except TimeoutError:
                continue
            if not data:
                return  # the hub closed: reconnect
            try:
                msg = _decoder.decode(data)
            except msgspec.DecodeError:
                continue
            if isinstance(msg, StageRelease):
                with self._lock:
                    for h in msg.hashes:
                        self._end(h)
            elif isinstance(msg, Stage):
                ok, failed = self._stage(msg.items)
                sock.send(_encoder.encode(Staged(self.rank, ok, failed)))

    def _stage(self, items: list[StageItem]) -> tuple[list[str], list[str]]:
        ok, failed = [], []
        with self._lock:  # an item held already: one more order for the same tensor
            todo = []
            for item in items:
                held = self._staged.get(item.mm_hash)
                if held is not None:
                    held[1] += 1
                    ok.append(item.mm_hash)
                else:
                    todo.append(item)
        if not todo:
            return ok, failed
        try:
            results = self._fetch(todo)
        except Exception as exc:  # never take the worker down: the items are encoded
            results = [f"staging failed: {exc}"] * len(todo)
        with self._lock:
            for item, result in zip(todo, results, strict=True):
                if isinstance(result, torch.Tensor):
                    held = self._staged.setdefault(item.mm_hash, [result, 0])
                    held[1] += 1
                    ok.append(item.mm_hash)
                else:
                    failed.append(item.mm_hash)
        return ok, failed

    def close(self) -> None:
        self._closed.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2)
        with self._lock:
            self._staged.clear()
