"""BrokerClient: synchronous, thread-safe client of one broker.

Failure model (what a serving engine can rely on):
- A broker outage never raises: ``has`` answers all-False, ``get`` None, ``put``
  False, quickly (bounded socket timeouts, then a reconnect backoff during which
  calls return at once). A warning is logged once per outage.
- A refusal by the broker (entry too large, no space, bad dtype/key, ...) raises
  ``BrokerRefused`` carrying the broker's code and message, so the caller can
  tell "not stored because of X" from "not stored because someone else did".
- After a reconnect the handshake's *epoch* says whether the broker restarted;
  if so the old mapping is dropped before the new segment is mapped, so no copy
  ever touches a stale segment. Every data operation runs under the client's
  lock from request to copy to commit/release, so a concurrent reconnect cannot
  unmap memory under a copy.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from ..config import default_socket_path
from ..protocol import (
    FRAME_HEADER,
    PROTOCOL_VERSION,
    Abort,
    Clear,
    Commit,
    Delete,
    DeleteReply,
    ErrorReply,
    Get,
    GetReply,
    Has,
    HasReply,
    Hello,
    HelloReply,
    Hit,
    Ping,
    PongReply,
    Release,
    Reply,
    Reserve,
    ReserveReply,
    ReserveStatus,
    Stats,
    StatsReply,
    expected_nbytes,
)
from ..shm.segment import Segment, ShmError

if TYPE_CHECKING:
    import torch

    from .copy import SlabView

log = logging.getLogger(__name__)


class BrokerUnavailable(ConnectionError):
    """The broker cannot be reached right now (internal; public calls turn it into a miss)."""


class BrokerRefused(RuntimeError):
    """The broker answered a request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class BrokerClient:
    def __init__(
        self,
        socket_path: str | None = None,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 1.0,
        max_backoff_s: float = 2.0,
        prefault: bool = True,
    ) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_backoff_s = max_backoff_s
        self.prefault = prefault
        self.client_id = uuid.uuid4().hex
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._hello: HelloReply | None = None
        self._segment: Segment | None = None
        self._slab: SlabView | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)
        self._header = bytearray(4)
        self._backoff = 0.0
        self._next_attempt = 0.0
        self._outage_logged = False
        self.reconnects = 0
        with self._lock:
            self._ensure_connected()

    # ------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def epoch(self) -> str | None:
        return self._hello.epoch if self._hello else None

    def _ensure_connected(self) -> bool:
        if self._sock is not None:
            return True
        now = time.monotonic()
        if now < self._next_attempt:
            return False
        try:
            self._connect()
        except (OSError, BrokerUnavailable, ShmError) as exc:
            self._backoff = min(max(self._backoff * 2, 0.05), self.max_backoff_s)
            self._next_attempt = time.monotonic() + self._backoff
            if not self._outage_logged:
                log.warning(
                    "lmcache-ec-broker at %s is unavailable (%s); serving misses and "
                    "retrying in the background",
                    self.socket_path,
                    exc,
                )
                self._outage_logged = True
            return False
        if self._outage_logged:
            log.info("reconnected to lmcache-ec-broker at %s", self.socket_path)
        self._outage_logged = False
        self._backoff = 0.0
        return True

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout_s)
        try:
            sock.connect(self.socket_path)
            sock.settimeout(self.timeout_s)
            self._sock = sock
            reply = self._roundtrip(Hello(PROTOCOL_VERSION, self.client_id, os.getpid()))
        except BaseException:
            self._drop_socket()
            sock.close()
            raise
        if isinstance(reply, ErrorReply):
            self._drop_socket()
            raise BrokerRefused(reply.code, reply.message)
        if not isinstance(reply, HelloReply):
            self._drop_socket()
            raise BrokerUnavailable(f"unexpected handshake reply {type(reply).__name__}")
        if self._hello is not None:
            self.reconnects += 1
            if self._hello.epoch != reply.epoch:
                self._unmap()  # the broker restarted: its old segment is gone
        self._hello = reply

    def _drop_socket(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None

    def _unmap(self) -> None:
        if self._slab is not None:
            self._slab.close()
            self._slab = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _slab_view(self) -> SlabView:
        if self._slab is None:
            from .copy import SlabView

            hello = self._hello
            assert hello is not None
            try:
                self._segment = Segment.attach(
                    hello.segment_name, hello.segment_size, self.prefault
                )
            except ShmError as exc:
                self._drop_socket()
                raise BrokerUnavailable(str(exc)) from exc
            self._slab = SlabView(self._segment.mm, hello.segment_size)
        return self._slab

    # ------------------------------------------------------------ transport

    def _recv_exactly(self, n: int) -> bytes:
        assert self._sock is not None
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise BrokerUnavailable("the broker closed the connection")
            got += k
        return bytes(buf)

    def _roundtrip(self, msg: msgspec.Struct) -> Any:
        sock = self._sock
        if sock is None:
            raise BrokerUnavailable("not connected")
        body = self._encoder.encode(msg)
        try:
            sock.sendall(FRAME_HEADER.pack(len(body)) + body)
            (length,) = FRAME_HEADER.unpack(self._recv_exactly(4))
            return self._decoder.decode(self._recv_exactly(length))
        except (OSError, msgspec.MsgspecError) as exc:
            # Timeouts land here too: the stream position is unknown, so start over.
            self._drop_socket()
            raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def _call(self, msg: msgspec.Struct) -> Any:
        """One request; raises BrokerUnavailable or BrokerRefused."""
        if not self._ensure_connected():
            raise BrokerUnavailable("not connected")
        reply = self._roundtrip(msg)
        if isinstance(reply, ErrorReply):
            raise BrokerRefused(reply.code, reply.message)
        return reply

    # ------------------------------------------------------------ public API

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Store ``tensor`` under ``key``. True if this call stored it; False if the entry
        is already present, another writer is storing it, or the broker is unavailable."""
        from .copy import dtype_name

        dtype = dtype_name(tensor.dtype)
        shape = list(tensor.shape)
        nbytes = expected_nbytes(dtype, shape)
        with self._lock:
            try:
                reply: ReserveReply = self._call(Reserve(key, nbytes, dtype, shape))
                if reply.status != ReserveStatus.RESERVED:
                    return False
                try:
                    self._slab_view().write(reply.extents, tensor)
                except BaseException:
                    if self._sock is not None:
                        try:
                            self._call(Abort(reply.token))
                        except (BrokerUnavailable, BrokerRefused):
                            pass
                    raise
                self._call(Commit(reply.token))
                return True
            except BrokerUnavailable:
                return False

    def get(self, key: str, device: str | torch.device = "cpu") -> torch.Tensor | None:
        return self.get_many([key], device)[0]

    def get_many(
        self, keys: list[str], device: str | torch.device = "cpu"
    ) -> list[torch.Tensor | None]:
        """New tensors (same dtype and shape as put) for the hits, None for misses."""
        import torch

        from .copy import torch_dtype

        dev = torch.device(device)
        with self._lock:
            try:
                reply: GetReply = self._call(Get(list(keys)))
            except BrokerUnavailable:
                return [None] * len(keys)
            hits: list[Hit] = [h for h in reply.items if h is not None]
            out: list[torch.Tensor | None] = []
            try:
                slab = self._slab_view() if hits else None
                for item in reply.items:
                    if item is None:
                        out.append(None)
                    else:
                        assert slab is not None
                        out.append(
                            slab.read(item.extents, torch_dtype(item.dtype), item.shape, dev)
                        )
            except BrokerUnavailable:
                return [None] * len(keys)
            finally:
                if hits and self._sock is not None:
                    try:
                        self._call(Release([h.pin for h in hits]))
                    except BrokerUnavailable:
                        pass  # the pins died with the connection
            return out

    def has(self, keys: list[str], lease_ms: int = 0) -> list[bool]:
        """One bool per key. ``lease_ms > 0`` protects each hit from eviction for that long
        (or until this client disconnects)."""
        with self._lock:
            try:
                reply: HasReply = self._call(Has(list(keys), lease_ms))
                return reply.hits
            except BrokerUnavailable:
                return [False] * len(keys)

    def delete(self, key: str) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            try:
                reply: DeleteReply = self._call(Delete(list(keys)))
                return reply.deleted
            except BrokerUnavailable:
                return [False] * len(keys)

    def clear(self) -> bool:
        with self._lock:
            try:
                self._call(Clear())
                return True
            except BrokerUnavailable:
                return False

    def stats(self) -> dict[str, Any]:
        """The broker's counters; {} while it is unavailable."""
        with self._lock:
            try:
                reply: StatsReply = self._call(Stats())
                return dict(reply.stats)
            except BrokerUnavailable:
                return {}

    def ping(self) -> bool:
        with self._lock:
            try:
                reply: PongReply = self._call(Ping())
                return reply.epoch == self.epoch
            except BrokerUnavailable:
                return False

    def close(self) -> None:
        with self._lock:
            self._drop_socket()
            self._unmap()
            self._hello = None

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._drop_socket()
        except Exception:
            pass
