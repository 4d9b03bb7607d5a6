"""Hostile and malformed input against a real broker process, over raw sockets.

Every case must end in an error reply or a closed connection; after every case
the broker still answers a fresh client and, once the fuzzing connections are
gone, holds nothing for them (no reservation, no pin) and its books balance.
Example counts are fixed so the whole module stays well under a minute.
"""

from __future__ import annotations

import os
import socket
import time

import msgspec
import pytest
import torch
from conftest import run_cli, wait_until
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.connector.client import BrokerRefused
from lmcache_ec_broker.protocol import (
    DTYPE_ITEMSIZE,
    FRAME_HEADER,
    PROTOCOL_VERSION,
    Abort,
    Clear,
    Commit,
    Delete,
    ErrorReply,
    Get,
    GetReply,
    Has,
    Hello,
    HelloReply,
    OkReply,
    Release,
    Reply,
    Reserve,
    ReserveReply,
    Stats,
)

MAX_FRAME = 64 * 1024
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Reply)
# How long an answer the broker owes may take: a wait for it, not a window, so 30 s (a
# loaded CI host may starve the broker for seconds); a broker that never answers still
# fails, only later.
ANSWER_S = 30.0


class Raw:
    """A connection that sends whatever it is told and reports what came back."""

    def __init__(self, path: str, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(ANSWER_S)
        self.sock.connect(path)
        self.buf = b""
        self.eof = False
        if hello:
            reply = self.call(Hello(PROTOCOL_VERSION, "fuzz"))
            assert isinstance(reply, HelloReply), reply

    def send_bytes(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.eof = True

    def send(self, msg: object) -> None:
        body = _enc.encode(msg)
        self.send_bytes(FRAME_HEADER.pack(len(body)) + body)

    def _frames(self) -> list:
        out = []
        while len(self.buf) >= 4:
            (n,) = FRAME_HEADER.unpack_from(self.buf)
            assert n <= 16 << 20, f"implausible reply frame of {n} bytes"
            if len(self.buf) < 4 + n:
                break
            out.append(_dec.decode(self.buf[4 : 4 + n]))  # a reply is always well formed
            self.buf = self.buf[4 + n :]
        return out

    def _recv(self, timeout: float) -> bool:
        """Read once; False on timeout or EOF."""
        if self.eof:
            return False
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return False
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def replies(self, wait: float = 0.3) -> list:
        """Every reply frame that arrives until the line is quiet for ``wait`` seconds."""
        out = self._frames()
        while self._recv(wait):
            out += self._frames()
        return out

    def call(self, msg: object):
        """Send one request and return its reply (None if the broker closed instead)."""
        self.send(msg)
        return self.call_sent()

    def call_sent(self):
        """The reply to what was just sent (None if the broker closed instead)."""
        deadline = time.monotonic() + ANSWER_S
        while True:
            got = self._frames()
            if got:
                assert len(got) == 1, got
                return got[0]
            if self.eof:
                return None
            assert time.monotonic() < deadline, f"no reply within {ANSWER_S:g} s"
            self._recv(0.5)

    def close(self) -> None:
        self.sock.close()

    # A test ends its connections however it ends: a failed example's open Raw, kept
    # alive by the traceback Hypothesis holds while it shrinks, would count as a client
    # in every later example's healthy() -- each then waiting ANSWER_S, one wrong reply
    # cascading into a long stall and the failure of the module's later tests.
    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def healthy(path: str, timeout: float = ANSWER_S) -> dict:
    """The broker answers a fresh client and holds nothing for closed connections."""
    with BrokerClient(path, timeout_s=ANSWER_S) as c:
        deadline = time.monotonic() + timeout
        while True:
            st = c.stats()
            assert st, "the broker stopped answering"
            held = st["used_bytes"] + st["reserved_bytes"] + st["arena_bytes"]  # + put arenas
            assert st["free_bytes"] + held == st["capacity_bytes"]
            if (st["clients"], st["reserved_bytes"], st["pins"], st["pinned_entries"]) == (
                1,
                0,
                0,
                0,
            ):
                return st
            assert time.monotonic() < deadline, f"leaked after the fuzz connections closed: {st}"
            time.sleep(0.02)


def _ensure_ready(path: str) -> None:
    """A few ready entries for get/has/release to hit."""
    with BrokerClient(path) as c:
        for i in range(4):
            c.put(f"ready-{i}", torch.full((1000,), i, dtype=torch.int32))
        assert c.has([f"ready-{i}" for i in range(4)]) == [True] * 4


@pytest.fixture(scope="module")
def fuzz_broker(tmp_path_factory):
    from conftest import BrokerProcess, shm_segments

    d = tmp_path_factory.mktemp("fz", numbered=True)
    path = str(d / "f.sock")
    b = BrokerProcess(
        path, ["--shm-size", "32MiB", "--max-frame-size", "64KiB", "--max-key-length", "256"]
    ).start()
    _ensure_ready(path)
    yield b
    assert b.proc.poll() is None, "the broker died during fuzzing:\n" + b.read_log()
    assert "Traceback" not in b.read_log(), b.read_log()
    assert b.stop() == 0
    assert shm_segments(path) == []


def _settle(raw: Raw, path: str) -> None:
    raw.replies(wait=0.05)
    raw.close()
    healthy(path)


# ---------------------------------------------------------------- byte-level


@FUZZ
@given(data=st.binary(max_size=4096), greet=st.booleans())
def test_random_bytes(fuzz_broker, data: bytes, greet: bool) -> None:
    with Raw(fuzz_broker.socket_path, hello=greet) as raw:
        raw.send_bytes(data)
        raw.replies(wait=0.05)  # whatever comes back must decode as a reply
        _settle(raw, fuzz_broker.socket_path)


@FUZZ
@given(length=st.integers(MAX_FRAME + 1, 2**32 - 1), tail=st.binary(max_size=64))
def test_oversized_length_prefix_is_refused_and_closed(
    fuzz_broker, length: int, tail: bytes
) -> None:
    with Raw(fuzz_broker.socket_path) as raw:
        raw.send_bytes(FRAME_HEADER.pack(length) + tail)
        got = raw.replies(wait=ANSWER_S)  # ends at the broker's close, as it should
        assert len(got) == 1 and isinstance(got[0], ErrorReply), got
        assert got[0].code == "bad_request"
        assert f"frame of {length} bytes exceeds the maximum of {MAX_FRAME} bytes" in got[0].message
        assert raw.eof, "the connection stayed open after an unframeable prefix"
        _settle(raw, fuzz_broker.socket_path)


@settings(FUZZ, max_examples=40)
@given(
    msg=st.sampled_from(
        [Reserve("t", 8, "float32", [2]), Get(["ready-0"]), Has(["ready-1"], 10), Stats()]
    ),
    cut=st.integers(0, 40),
)
def test_truncated_frames_then_close(fuzz_broker, msg, cut: int) -> None:
    body = _enc.encode(msg)
    frame = FRAME_HEADER.pack(len(body)) + body
    with Raw(fuzz_broker.socket_path) as raw:
        raw.send_bytes(frame[: min(cut, len(frame) - 1)])
        assert raw.replies(wait=0.05) == []  # waits for the rest; no reply to half a frame
        _settle(raw, fuzz_broker.socket_path)


# ---------------------------------------------------------------- msgpack of the wrong shape

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
_OPS = [
    "hello",
    "has",
    "reserve",
    "commit",
    "abort",
    "get",
    "release",
    "delete",
    "clear",
    "stats",
    "ping",
]
_FIELDS = [
    "keys",
    "key",
    "nbytes",
    "dtype",
    "shape",
    "token",
    "pins",
    "lease_ms",
    "version",
    "client_id",
    "pid",
]


@FUZZ
@given(
    value=_values
    | st.fixed_dictionaries(
        {"op": st.sampled_from(_OPS) | st.text(max_size=8)},
        optional={f: _values for f in _FIELDS},
    )
)
def test_valid_msgpack_of_the_wrong_shape(fuzz_broker, value) -> None:
    with Raw(fuzz_broker.socket_path) as raw:
        raw.send(value)
        first = raw.call_sent()
        got = ([first] if first is not None else []) + raw.replies(wait=0.01)
        # Either a typed reply (some random dicts are valid requests) or a clear error.
        assert got or raw.eof, "no reply and no close"
        for r in got:
            if isinstance(r, ErrorReply):
                assert r.code and r.message
        _settle(raw, fuzz_broker.socket_path)


# ---------------------------------------------------------------- well-typed, absurd values

_ints = st.integers(-(2**63), 2**63 - 1) | st.sampled_from([0, 1, -1, 2**31, 2**62, 32 << 20])
_dtypes = st.sampled_from(sorted(DTYPE_ITEMSIZE)) | st.text(max_size=12)
_shapes = st.lists(_ints | st.integers(0, 4096), max_size=20)
_keys = st.text(max_size=300) | st.sampled_from(["ready-0", "ready-1", "", "x" * 257])


@FUZZ
@given(key=_keys, nbytes=_ints, dtype=_dtypes, shape=_shapes)
# Consistent and within the slab, but more than one process may keep from eviction
# (max_held_bytes_per_process, half the slab by default): a refusal, not a reservation.
@example(key="whole-slab", nbytes=32 << 20, dtype="uint8", shape=[32 << 20])
def test_reserve_with_absurd_numbers(fuzz_broker, key, nbytes, dtype, shape) -> None:
    with Raw(fuzz_broker.socket_path) as raw:
        r = raw.call(Reserve(key, nbytes, dtype, shape))
        if isinstance(r, ReserveReply) and r.status == "reserved":
            # Only a request that is consistent with itself may get blocks.
            assert 0 <= nbytes <= 32 << 20 and dtype in DTYPE_ITEMSIZE and 0 < len(key) <= 256
            assert sum(n for _, n in r.extents) == nbytes
            assert all(0 <= off and off + n <= 32 << 20 for off, n in r.extents)
        else:
            assert isinstance(r, ErrorReply | ReserveReply), r
            if isinstance(r, ErrorReply):
                assert r.code in {
                    "key_invalid",
                    "dtype_invalid",
                    "shape_mismatch",
                    "too_large",
                    "no_space",
                    "too_many_reservations",
                    "bad_request",
                }, r
                assert len(r.message) > 10
        _settle(raw, fuzz_broker.socket_path)  # an open reservation dies with the connection


@FUZZ
@given(
    ops=st.lists(
        st.one_of(
            st.builds(Commit, _ints),
            st.builds(Abort, _ints),
            st.builds(Release, st.lists(_ints, max_size=8)),
            st.builds(Has, st.lists(_keys, max_size=8), _ints),
            st.builds(Get, st.lists(_keys, max_size=8)),
            st.builds(Delete, st.lists(st.text(max_size=10), max_size=4)),
            st.builds(Hello, _ints, st.text(max_size=10), _ints),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_typed_requests_with_random_tokens_and_keys(fuzz_broker, ops) -> None:
    _ensure_ready(fuzz_broker.socket_path)  # earlier fuzzing may have sent a valid clear
    with Raw(fuzz_broker.socket_path) as raw:
        for op in ops:
            r = raw.call(op)
            if isinstance(op, Commit | Abort):
                # No token was ever issued to this connection.
                assert isinstance(r, ErrorReply) and r.code == "unknown_token", r
            elif isinstance(op, Release) and op.pins:
                assert isinstance(r, ErrorReply) and r.code == "unknown_token", r
            elif isinstance(op, Hello):
                assert isinstance(r, ErrorReply) and "already" in r.message
            else:
                assert r is not None and not isinstance(r, ErrorReply), r
        # Its gets and leases pinned real entries; closing must release every one.
        _settle(raw, fuzz_broker.socket_path)
        with BrokerClient(fuzz_broker.socket_path) as c:
            assert c.has([f"ready-{i}" for i in range(4)]) == [True] * 4  # nobody deleted these


# ---------------------------------------------------------------- tokens and pins that are not yours


def test_tokens_and_pins_of_another_connection_or_already_spent(fuzz_broker) -> None:
    path = fuzz_broker.socket_path
    with Raw(path) as a, Raw(path) as b:
        res = a.call(Reserve("mine", 16, "float32", [4]))
        assert isinstance(res, ReserveReply) and res.status == "reserved"
        for op in (Commit(res.token), Abort(res.token)):  # B may not finish A's reservation
            r = b.call(op)
            assert isinstance(r, ErrorReply) and r.code == "unknown_token"
            assert "not an open reservation of this connection" in r.message
        assert isinstance(a.call(Commit(res.token)), OkReply)
        for op in (Commit(res.token), Abort(res.token)):  # double commit, abort after commit
            r = a.call(op)
            assert isinstance(r, ErrorReply) and r.code == "unknown_token"
        got = a.call(Get(["mine"]))
        assert isinstance(got, GetReply) and got.items[0] is not None
        pin = got.items[0].pin
        r = b.call(Release([pin]))  # B may not release A's pin
        assert isinstance(r, ErrorReply) and r.code == "unknown_token"
        assert isinstance(a.call(Release([pin])), OkReply)
        r = a.call(Release([pin]))  # released twice
        assert isinstance(r, ErrorReply) and "released twice" in r.message
        got = a.call(Get(["mine"]))
        pin2 = got.items[0].pin
        a.close()  # release after close: the pin died with A, B cannot use it
        time.sleep(0.1)
        r = b.call(Release([pin2]))
        assert isinstance(r, ErrorReply) and r.code == "unknown_token"
        assert isinstance(b.call(Delete(["mine"])), msgspec.Struct)
    healthy(path)


def test_clear_while_another_connection_holds_pins_and_reservations(fuzz_broker) -> None:
    path = fuzz_broker.socket_path
    with Raw(path) as a, Raw(path) as b:
        res = a.call(Reserve("clr", 1 << 20, "uint8", [1 << 20]))
        got = a.call(Get(["ready-2"]))
        assert isinstance(got, GetReply) and got.items[0] is not None
        assert isinstance(b.call(Clear()), OkReply)
        # A still owns its reservation and its pin; both end cleanly.
        assert isinstance(a.call(Commit(res.token)), OkReply)
        assert isinstance(a.call(Release([got.items[0].pin])), OkReply)
    st = healthy(path)
    assert st["entries"] == 1  # only "clr" (committed after the clear)
    with BrokerClient(path) as c:
        c.delete("clr")
    _ensure_ready(path)


# ---------------------------------------------------------------- limits


def test_limits_refuse_with_clear_messages(make_broker) -> None:
    b = make_broker(
        "--shm-size",
        "16MiB",
        "--max-entry-size",
        "1MiB",
        "--max-key-length",
        "64",
        "--max-frame-size",
        "8KiB",
        "--max-connections",
        "3",
    )
    path = b.socket_path
    with BrokerClient(path) as c:
        with pytest.raises(BrokerRefused) as exc:
            c.put("k" * 65, torch.zeros(4))
        assert (
            exc.value.code == "key_invalid"
            and "65 characters long; the maximum is 64" in exc.value.message
        )
        assert c.put("k" * 64, torch.zeros(4))
        with pytest.raises(BrokerRefused) as exc:
            c.put("big", torch.zeros((1 << 20) + 1, dtype=torch.uint8))
        assert exc.value.code == "too_large"
        assert "exceeds the maximum entry size of 1048576 bytes" in exc.value.message
        assert c.put("fits", torch.zeros(1 << 20, dtype=torch.uint8))
        # A request larger than the frame limit: a clear refusal, then the client goes on.
        with pytest.raises(BrokerRefused) as exc:
            c.delete_many([f"key-{i:08d}" for i in range(2000)])
        assert exc.value.code == "bad_request"
        assert "exceeds the broker's maximum frame of 8192 bytes" in exc.value.message
        assert c.has(["fits"]) == [True]
        # Connections: this one plus two more; the fourth is refused, clearly.
        others = [BrokerClient(path), BrokerClient(path)]
        with pytest.raises(BrokerRefused) as exc:
            BrokerClient(path)
        assert exc.value.code == "too_many_connections"
        assert "already serves 3 connections" in exc.value.message
        others.pop().close()

        def admitted() -> BrokerClient | None:
            try:
                return BrokerClient(path)
            except BrokerRefused as e:  # the close is not handled yet (a loaded host)
                assert e.code == "too_many_connections", e
                return None

        # Retried, not slept for: the slot comes back once the broker has seen the close.
        with wait_until(admitted, "the closed connection's slot", timeout=ANSWER_S) as again:
            assert again.ping()
        for o in others:
            o.close()
    healthy(path)


def test_max_entry_size_larger_than_the_slab_is_refused_at_start(sock_dir) -> None:
    out = run_cli(
        "start",
        "--socket",
        os.path.join(sock_dir, "m.sock"),
        "--shm-size",
        "64MiB",
        "--max-entry-size",
        "128MiB",
    )
    assert out.returncode == 2, out.stderr
    assert "max_entry_size" in out.stderr and "shm_size" in out.stderr
