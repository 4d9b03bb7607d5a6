"""A hypothesis model of the broker's settle/dispatch order (issue 29, item 1).

The real ``BrokerServer`` and real ``Connection`` objects, each over a real socketpair;
what the event loop would decide is left to hypothesis: WHICH connection's socket the
loop reads next and HOW MANY bytes (partial frames included), and when each client
sends, and reads its replies. Only the loop's transport is replaced (it hands replies
to the client model directly and never pauses), because the order of reads is what
this test explores; tests/test_read_after_put.py runs the same promise on real brokers.

Clients behave as BrokerClient does: a request that waits (Reserve, ArenaGrant, Get,
Has, Delete) is the last thing sent until its reply arrives; Commit (after a reserved
reply), Place (from the connection's arena, after marking the journal) and Release are
posted. A put "returns" when its Commit or Place is posted.

The promise checked on every reply: a get/has that misses, or a delete that finds
nothing, for a key some put of which returned before the request was sent, is excused
only by a delete of that key the broker could have handled after that put (sent before
this reply came, answered after that put began, or not answered yet). Nothing is ever
evicted (the slab is far larger than the keys), so there is no other excuse.

On the old code (a request read inside another connection's settle was not settled)
``test_the_order_the_issue_reproduced`` fails (all six variants); the random search
reaches such reads (~80 per 400 examples) but did not hit the three-connection
order that misses within 400 examples, so it is the explicit run that fails first and
the search that guards the rest of the order space. Since issue 40 item 4 such a
request is deferred and handled after the one being settled (never nested), which
this model checks the same way: every reply, in order, no miss."""

from __future__ import annotations

import collections
import os
import socket
import tempfile
import uuid

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_ec_broker.broker.server import BrokerServer
from lmcache_ec_broker.config import BrokerConfig
from lmcache_ec_broker.protocol import (
    FRAME_HEADER,
    ArenaGrant,
    ArenaReply,
    Commit,
    Delete,
    DeleteReply,
    Get,
    GetReply,
    Has,
    HasReply,
    OkReply,
    Place,
    PlaceReply,
    Release,
    Reply,
    Reserve,
    ReserveReply,
    encode_frame,
)
from lmcache_ec_broker.shm.journal import Journal

BS = 4096
NCLIENTS = 3
KEYS = ["k0", "k1", "k2"]
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Reply)


class LoopTransport:
    """The part of an asyncio transport Connection uses; replies go to ``replies``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.replies: list[object] = []
        self.closing = False
        self._buf = b""

    def get_extra_info(self, name: str) -> object:
        return self.sock if name == "socket" else None

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def write(self, data: bytes) -> None:
        self._buf += data
        while len(self._buf) >= 4:
            (n,) = FRAME_HEADER.unpack_from(self._buf)
            if len(self._buf) < 4 + n:
                break
            self.replies.append(_dec.decode(self._buf[4 : 4 + n]))
            self._buf = self._buf[4 + n :]

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        raise AssertionError("nothing here should pause reading")

    def resume_reading(self) -> None:
        pass


class PutRecord:
    def __init__(self, key: str, began: int, returned: int, place_at: int | None) -> None:
        self.key = key
        self.began = began
        self.returned = returned
        self.place_at = place_at  # index of the Place's reply on its connection (arena put)


class Client:
    def __init__(self, idx: int, server: BrokerServer) -> None:
        self.idx = idx
        self.sock, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.setblocking(False)
        self.peer = peer
        self.transport = LoopTransport(peer)
        from lmcache_ec_broker.broker.connection import Connection

        self.conn = Connection(server)
        self.conn.connection_made(self.transport)  # type: ignore[arg-type]
        assert not self.transport.closing, self.transport.replies  # admitted
        self.conn.greeted = True  # the handshake is not what this models
        self.expect: collections.deque[tuple[str, object]] = collections.deque()
        self.replied = 0  # replies handled
        self.sent = 0  # requests that get a reply
        self.waiting = False  # a request that waits is outstanding
        self.slot = -1
        self.arena: set[int] = set()
        self.seq = 0
        self.puts: dict[int, PutRecord] = {}  # Place's reply index -> its put

    def send(self, msg: msgspec.Struct, kind: str, info: object = None, wait: bool = True) -> int:
        self.sock.sendall(encode_frame(_enc, msg))
        self.expect.append((kind, info))
        self.sent += 1
        if wait:
            self.waiting = True
        return self.sent - 1

    def close(self) -> None:
        self.sock.close()
        self.peer.close()


class SettleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ecb-m-")
        cfg = BrokerConfig(
            socket_path=os.path.join(self.dir, "b.sock"),
            shm_size=512 * BS,
            block_size=BS,
            put_arena_bytes=16 * BS,
            max_connections=8,
        )
        self.server = BrokerServer(cfg)
        self.server.journal = Journal.create(f"/ecb-model-{uuid.uuid4().hex[:12]}-j", 8)
        self.clients = [Client(i, self.server) for i in range(NCLIENTS)]
        for i, c in enumerate(self.clients):  # each holds a put arena from the start
            c.send(ArenaGrant(16 * BS), "grant")
            self.loop_reads(i, 1 << 16)
            self.receive(i)
            assert c.slot >= 0 and len(c.arena) == 16
        self.now = 0
        self.returned: list[PutRecord] = []
        # Deletes: (key, sent, answered or None), for the excuses.
        self.deletes: list[list] = []

    def teardown(self) -> None:
        for c in self.clients:
            c.close()
        journal = self.server.journal
        if journal is not None:
            journal.close()
        os.rmdir(self.dir)

    def tick(self) -> int:
        self.now += 1
        return self.now

    # ------------------------------------------------------------ the loop

    @rule(
        i=st.integers(0, NCLIENTS - 1),
        size=st.sampled_from([1 << 16, 1 << 16, 1 << 16, 1, 7, 64]),
        answer=st.booleans(),
    )
    def loop_reads(self, i: int, size: int, answer: bool = False) -> None:
        """The loop reads ``size`` bytes of client ``i``'s socket (partial frames too);
        ``answer``: then every client handles the replies it has at once."""
        c = self.clients[i]
        try:
            data = os.read(c.peer.fileno(), size)
        except BlockingIOError:
            return
        if data:
            c.conn.data_received(data)
        if answer:
            self.clients_answer()

    @rule(order=st.permutations(range(NCLIENTS)), answer=st.booleans())
    def loop_turn(self, order: list[int], answer: bool) -> None:
        """One turn of the loop: every ready socket read, in the order epoll returns."""
        for i in order:
            self.loop_reads(i, 1 << 16)
        if answer:
            self.clients_answer()

    @rule()
    def clients_answer(self) -> None:
        """Every client handles the replies it has (clients faster than the broker)."""
        for i in range(NCLIENTS):
            c = self.clients[i]
            while len(c.transport.replies) > c.replied:
                self.receive(i)

    # ------------------------------------------------------------ clients

    def idle(self) -> list[int]:
        return [c.idx for c in self.clients if not c.waiting]

    @precondition(lambda self: self.idle())
    @rule(data=st.data(), key=st.sampled_from(KEYS), nblocks=st.integers(1, 2))
    def put_reserve(self, data: st.DataObject, key: str, nblocks: int) -> None:
        self.put_reserve_by(data.draw(st.sampled_from(self.idle())), key, nblocks)

    def put_reserve_by(self, i: int, key: str, nblocks: int) -> None:
        c = self.clients[i]
        began = self.tick()
        c.send(Reserve(key, nblocks * BS, "uint8", [nblocks * BS]), "reserve", (key, began))

    def placers(self) -> list[int]:
        return [c.idx for c in self.clients if not c.waiting and c.slot >= 0 and len(c.arena) >= 2]

    @precondition(lambda self: self.placers())
    @rule(data=st.data(), key=st.sampled_from(KEYS), nblocks=st.integers(1, 2))
    def put_place(self, data: st.DataObject, key: str, nblocks: int) -> None:
        self.put_place_by(data.draw(st.sampled_from(self.placers())), key, nblocks)

    def put_place_by(self, i: int, key: str, nblocks: int) -> None:
        c = self.clients[i]
        blocks = sorted(c.arena)[:nblocks]
        c.arena -= set(blocks)
        c.seq += 1
        journal = self.server.journal
        assert journal is not None
        journal.mark_placed(c.slot, c.seq)  # before the Place is sent (shm/journal.py)
        began = self.tick()
        runs = [(b, 1) for b in blocks]
        msg = Place(key, nblocks * BS, "uint8", [nblocks * BS], runs, c.seq)
        at = c.send(msg, "place", blocks, wait=False)
        rec = PutRecord(key, began, self.tick(), at)  # put() returned
        c.puts[at] = rec
        self.returned.append(rec)

    @precondition(lambda self: self.idle())
    @rule(data=st.data(), op=st.sampled_from(["get", "has", "delete"]), key=st.sampled_from(KEYS))
    def read(self, data: st.DataObject, op: str, key: str) -> None:
        self.read_by(data.draw(st.sampled_from(self.idle())), op, key)

    def read_by(self, i: int, op: str, key: str) -> None:
        c = self.clients[i]
        sent = self.tick()
        if op == "delete":
            rec = [key, sent, None]
            self.deletes.append(rec)
            c.send(Delete([key]), "delete", (key, sent, rec))
        else:
            c.send(Get([key]) if op == "get" else Has([key]), op, (key, sent))

    def answered(self) -> list[int]:
        return [c.idx for c in self.clients if len(c.transport.replies) > c.replied]

    @precondition(lambda self: self.answered())
    @rule(data=st.data())
    def receive_one(self, data: st.DataObject) -> None:
        self.receive(data.draw(st.sampled_from(self.answered())))

    def receive(self, i: int) -> None:
        c = self.clients[i]
        reply = c.transport.replies[c.replied]
        index = c.replied
        c.replied += 1
        kind, info = c.expect.popleft()
        if kind in ("reserve", "grant", "get", "has", "delete"):
            c.waiting = False
        if kind == "reserve":
            key, began = info  # type: ignore[misc]
            assert isinstance(reply, ReserveReply), reply
            if reply.status == "reserved":
                c.send(Commit(reply.token), "ok", wait=False)  # posted: put() returns
                self.returned.append(PutRecord(key, began, self.tick(), None))
        elif kind == "grant":
            assert isinstance(reply, ArenaReply), reply
            if reply.slot >= 0:
                c.slot = reply.slot
            for start, n in reply.runs:
                c.arena.update(range(start, start + n))
        elif kind == "place":
            assert isinstance(reply, PlaceReply), reply
            if not reply.stored:
                c.arena.update(info)  # type: ignore[arg-type]
        elif kind == "ok":
            assert isinstance(reply, OkReply), reply
        elif kind == "get":
            assert isinstance(reply, GetReply), reply
            key, sent = info  # type: ignore[misc]
            hit = reply.items[0]
            if hit is None:
                self.check_miss(key, sent, None)
            else:
                c.send(Release([hit.pin]), "ok", wait=False)
        elif kind == "has":
            assert isinstance(reply, HasReply), reply
            key, sent = info  # type: ignore[misc]
            if not reply.hits[0]:
                self.check_miss(key, sent, None)
        elif kind == "delete":
            assert isinstance(reply, DeleteReply), reply
            key, sent, rec = info  # type: ignore[misc]
            rec[2] = self.tick()
            if not reply.deleted[0]:
                self.check_miss(key, sent, rec)
        else:
            raise AssertionError(kind)
        del index

    def check_miss(self, key: str, sent: int, own: list | None) -> None:
        """A miss of ``key`` by a request sent at ``sent``, answered now."""
        now = self.tick()
        for put in self.returned:
            if put.key != key or put.returned >= sent:
                continue
            if put.place_at is not None and not self._stored(put):
                continue  # a Place of a key already present or reserved: nothing stored
            excused = any(
                d is not own and d[0] == key and d[1] < now and (d[2] is None or d[2] > put.began)
                for d in self.deletes
            )
            assert excused, (
                f"read-after-put broken: {key!r} put returned at t={put.returned}, "
                f"a request sent at t={sent} missed it (no delete could explain it)"
            )

    def _stored(self, put: PutRecord) -> bool:
        for c in self.clients:
            if c.puts.get(put.place_at) is put:  # type: ignore[arg-type]
                replies = c.transport.replies
                if len(replies) <= put.place_at:  # type: ignore[operator]
                    raise AssertionError(
                        f"a request was answered before the Place of {put.key!r}, whose "
                        "put() had returned before that request was sent"
                    )
                reply = replies[put.place_at]  # type: ignore[index]
                return isinstance(reply, PlaceReply) and reply.stored
        raise AssertionError("unknown put")

    @invariant()
    def store_is_consistent(self) -> None:
        self.server.store.check()
        assert self.server.store.counters["evictions"] == 0


@pytest.mark.parametrize("how", ["reserve", "place"])
@pytest.mark.parametrize("op", ["get", "has", "delete"])
def test_the_order_the_issue_reproduced(how: str, op: str) -> None:
    # The interleaving of issue 29 item 1, as one run of the model: A's put of k0 and C's
    # put of k1 returned (their Commit/Place wait in their sockets); B asks for k0 and A
    # for k1; the loop reads B first. B's settle handles A's frames -- A's Commit/Place,
    # then A's request for k1, nested -- and that request must be settled too (C read).
    # Seen failing on the old code (A's get/has missed k1, its delete found nothing).
    m = SettleMachine()
    try:
        a, b, c = 0, 1, 2
        for who, key in ((a, "k0"), (c, "k1")):
            if how == "reserve":
                m.put_reserve_by(who, key, 1)
                m.loop_reads(who, 1 << 16)
                m.receive(who)  # the Commit is posted: put() returned
            else:
                m.put_place_by(who, key, 1)  # posted: put() returned
        m.read_by(b, "has", "k0")
        m.read_by(a, op, "k1")
        m.loop_reads(b, 1 << 16)
        m.clients_answer()
        assert not any(cl.waiting for cl in m.clients)
    finally:
        m.teardown()


SettleMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("SETTLE_EXAMPLES", "300")),
    stateful_step_count=60,
    deadline=None,
)
TestSettleOrder = SettleMachine.TestCase
