"""A broker hears its OWN announcements back (Redis pub/sub delivers a PUBLISH to every
subscriber, the publisher's too), on the subscriber thread, some time after the write
that published it ended. If a delete of the key ran meanwhile, learning the key from
that late echo put a deleted key back into the filter: ``remote_known_keys`` 1 after
the delete (the flake of test_remote_fleet.py's ``*-write-ends`` cases under load),
and the next write-behind of the key was skipped as "already in the store" -- the
re-put value never reached the fleet.

The policy is driven directly (deterministic: the echo arrives exactly after the
delete), then the same with real brokers and a real redis-server, the subscriber's
pushes delayed by the proxy (tests/delay_proxy.py ``push_delay_s``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from conftest import wait_until
from delay_proxy import DelayProxy
from redis_servers import REDIS_SERVER, RedisServer

from lmcache_ec_broker.broker.tiers.base import EntryMeta
from lmcache_ec_broker.broker.tiers.remote.discovery import ECHO_TTL_S
from lmcache_ec_broker.broker.tiers.remote.jobs import (
    DeleteJob,
    Job,
    Limits,
    LookupJob,
    WriteBatch,
    WriteJob,
)
from lmcache_ec_broker.broker.tiers.remote.policy import RemotePolicy
from lmcache_ec_broker.broker.tiers.remote.transport import Outcome, StoreDown

META = EntryMeta(64, "uint8", (64,))


class Runner:
    """Records what the policy dispatches; the test finishes each job by hand."""

    def __init__(self) -> None:
        self.pending: list[Job] = []
        self.filter: set[str] = set()

    def dispatch(self, job: Job) -> None:
        self.pending.append(job)

    def answered(self, job: LookupJob) -> None: ...
    def write_ended(self, job: WriteJob) -> None: ...

    def added(self, key: str) -> None:
        self.filter.add(key)

    def removed(self, key: str) -> None:
        self.filter.discard(key)

    def later(self, delay_s: float, fn: Callable[[], None]) -> None: ...

    def take(self, kind: type[Job]) -> Job:
        job = next(j for j in self.pending if isinstance(j, kind))
        self.pending.remove(job)
        return job


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(announces: bool = True, clock: Clock | None = None) -> tuple[RemotePolicy, Runner]:
    runner = Runner()
    lim = Limits(
        timeout_s=1.0,
        write_queue=16,
        max_pending_bytes=1 << 20,
        max_entry_bytes=1 << 20,
        filter_cap=1024,
        announces=announces,
    )
    return RemotePolicy(lim, runner, node_of=lambda k: "n0", clock=clock or Clock()), runner


def stored(pol: RemotePolicy, runner: Runner) -> None:
    pol.finished(runner.take(WriteBatch), [Outcome.STORED])


def deleted(pol: RemotePolicy, runner: Runner) -> None:
    job = runner.take(DeleteJob)
    pol.finished(job, dict.fromkeys(job.keys))


def assert_forgotten(pol: RemotePolicy, runner: Runner, key: str) -> None:
    assert key not in pol.known, "a deleted key came back into the filter"
    assert key not in runner.filter
    assert pol.write(key, META, []) is not None, "the next write of a deleted key was skipped"


def test_own_echo_after_a_delete_during_the_write_is_not_learned() -> None:
    """The fleet test's interleaving: delete while the write is in flight, the write
    ends STORED (its PUBLISH sent), the delete runs, then the echo arrives."""
    pol, runner = policy()
    assert pol.write("doomed", META, []) is not None
    pol.delete(["doomed"])
    stored(pol, runner)
    deleted(pol, runner)
    assert not pol.deleting and "doomed" not in pol.known
    pol.announced(["doomed"])  # A's own announcement, heard late
    assert_forgotten(pol, runner, "doomed")


def test_own_echo_after_a_delete_of_a_stored_key_is_not_learned() -> None:
    """The write ended (key learned) and the delete ran before the echo was heard."""
    pol, runner = policy()
    assert pol.write("k", META, []) is not None
    stored(pol, runner)
    assert "k" in pol.known
    pol.delete(["k"])
    deleted(pol, runner)
    pol.announced(["k"])
    assert_forgotten(pol, runner, "k")


def test_own_echo_after_a_clear_is_not_learned() -> None:
    pol, runner = policy()
    assert pol.write("k", META, []) is not None
    stored(pol, runner)
    pol.clear()
    pol.finished(runner.pending.pop(), 1)  # the ClearJob
    pol.announced(["k"])
    assert_forgotten(pol, runner, "k")


def test_other_brokers_announcements_are_still_learned() -> None:
    """Only echoes are swallowed: one per own STORED write. A second announcement of
    the key (another broker wrote it after the delete) is learned."""
    pol, runner = policy()
    assert pol.write("k", META, []) is not None
    stored(pol, runner)
    pol.delete(["k"])
    deleted(pol, runner)
    pol.announced(["k"])  # the echo
    pol.announced(["k"])  # another broker's write of it
    assert "k" in pol.known and "k" in runner.filter
    pol.announced(["other"])  # never written here: learned at once
    assert "other" in pol.known


def test_echo_heard_before_the_delete_changes_nothing() -> None:
    """The usual order (echo heard at once): the delete still forgets the key, and a
    later announcement by another broker is learned."""
    pol, runner = policy()
    assert pol.write("k", META, []) is not None
    stored(pol, runner)
    pol.announced(["k"])
    assert "k" in pol.known
    pol.delete(["k"])
    deleted(pol, runner)
    assert "k" not in pol.known
    pol.announced(["k"])
    assert "k" in pol.known


def test_echo_heard_before_the_write_ended_is_not_expected_again() -> None:
    """The subscriber thread can hand the echo to the loop before the write's own
    completion: it is taken as the echo then, and nothing waits for it afterwards."""
    pol, runner = policy()
    assert pol.write("k", META, []) is not None
    pol.announced(["k"])  # published, heard; the write's end not processed yet
    stored(pol, runner)
    assert "k" in pol.known
    pol.delete(["k"])
    deleted(pol, runner)
    pol.announced(["k"])  # another broker wrote it after the delete: news
    assert "k" in pol.known


def test_a_write_that_published_nothing_expects_no_echo() -> None:
    """A write that ended FAILED, REJECTED or PRESENT announced nothing: the next
    announcement of its key is another broker's, and is learned."""
    for result in ([Outcome.FAILED], [Outcome.REJECTED], [Outcome.PRESENT], StoreDown([], "x")):
        pol, runner = policy()
        assert pol.write("k", META, []) is not None
        pol.finished(runner.take(WriteBatch), result)
        assert not pol.echoes, result
        pol.announced(["k"])
        assert "k" in pol.known, result


def test_an_echo_never_heard_is_forgotten() -> None:
    """The subscriber reconnected and the echo was lost: after ECHO_TTL_S from the
    write's end, announcements of the key are learned again."""
    clock = Clock()
    pol, runner = policy(clock=clock)
    assert pol.write("k", META, []) is not None
    stored(pol, runner)
    pol.delete(["k"])
    deleted(pol, runner)
    clock.now += ECHO_TTL_S + 0.1
    pol.announced(["k"])
    assert "k" in pol.known
    assert not pol.echoes


def test_no_echo_is_expected_from_a_store_that_does_not_announce() -> None:
    """Mooncake (announces=False): nothing is published, so nothing is swallowed."""
    pol, runner = policy(announces=False)
    assert pol.write("k", META, []) is not None
    stored(pol, runner)
    pol.delete(["k"])
    deleted(pol, runner)
    pol.announced(["k"])
    assert "k" in pol.known


# ---------------------------------------------------------------- real brokers

torch = pytest.importorskip("torch")
from lmcache_ec_broker import BrokerClient  # noqa: E402

PREFIX = "lmcache-ec:"
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")


def tensor(seed: int) -> torch.Tensor:
    return torch.randn((128, 128), generator=torch.Generator().manual_seed(seed))


def rstats(c: BrokerClient) -> dict[str, int]:
    return {k: v for k, v in c.stats().items() if k.startswith("remote_")}


@pytest.fixture
def server() -> Iterator[RedisServer]:
    srv = RedisServer(kind="redis")
    yield srv
    srv.stop()


@pytest.fixture
def node(make_broker, tmp_path) -> Iterator[Callable[[str], BrokerClient]]:
    clients: list[BrokerClient] = []

    def make(url: str) -> BrokerClient:
        cfg = tmp_path / f"node{len(clients)}.yaml"
        cfg.write_text(f"remote_url: '{url}'\nremote_timeout_s: 1.0\n")
        b = make_broker("--shm-size", "64MiB", "--config", str(cfg))
        clients.append(BrokerClient(b.socket_path, timeout_s=30.0))
        return clients[-1]

    yield make
    for c in clients:
        c.close()


@needs_redis
@pytest.mark.parametrize("in_flight", [True, False], ids=["delete-during-write", "delete-after"])
def test_late_own_announcement_does_not_bring_a_deleted_key_back(
    server, node, in_flight: bool
) -> None:
    """A's subscriber hears its own announcement 1.5 s late (a loaded host); A deletes
    the key meanwhile. The key must stay forgotten, and when A puts it again the
    write-behind must store it, so that B finds the new value."""
    with DelayProxy(server.port) as proxy:
        a = node(proxy.url(server.password))
        b = node(server.url("unix"))
        proxy.push_delay_s = 1.5
        if in_flight:
            proxy.hold_s["SET"] = 0.5
        assert a.put("doomed", tensor(1))
        if in_flight:
            assert proxy.holding.wait(10), "the write-behind never sent its SET"
        else:
            wait_until(lambda: rstats(a)["remote_writes"] == 1, what="A's write")
        assert a.delete("doomed")
        proxy.hold_s.clear()
        wait_until(
            lambda: rstats(a)["remote_pending_writes"] == 0
            and server.cli("exists", PREFIX + "doomed") == "0",
            what="the write settled, the key gone from the store",
        )
        assert proxy.pushes_delivered == 0, "the echo came before the delete ended"
        wait_until(lambda: rstats(a)["remote_announcements"] >= 1, what="A hears its own echo")
        wait_until(lambda: rstats(b)["remote_announcements"] >= 1, what="B hears it")
        assert rstats(a)["remote_known_keys"] == 0, "a deleted key came back into A's filter"
        again = tensor(2)
        assert a.put("doomed", again)
        wait_until(
            lambda: rstats(a)["remote_writes"] + rstats(a)["remote_writes_skipped"] >= 2,
            what="A's second write-behind",
        )
        assert rstats(a)["remote_writes"] == 2, "the re-put was skipped as already stored"
        got = b.get("doomed")
        assert got is not None and torch.equal(got, again)
