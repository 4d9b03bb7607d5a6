"""``RemotePolicy`` is one object in parts (mixins over its state). What a part calls on
the policy is declared once, abstract (``remote/part.py``): a policy lacking one of
those methods cannot be made, and no declaration answers None in place of the real
method, whatever order the parts are listed in."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from lmcache_ec_broker.broker.tiers.remote.jobs import Job, Limits
from lmcache_ec_broker.broker.tiers.remote.part import PolicyPart
from lmcache_ec_broker.broker.tiers.remote.policy import RemotePolicy


class Runner:
    def dispatch(self, job: Job) -> None: ...
    def answered(self, job: Job) -> None: ...
    def write_ended(self, job: Job) -> None: ...
    def added(self, key: str) -> None: ...
    def removed(self, key: str) -> None: ...
    def later(self, delay_s: float, fn: Callable[[], None]) -> None: ...


LIMITS = Limits(
    timeout_s=1.0,
    write_queue=16,
    max_pending_bytes=1 << 20,
    max_entry_bytes=1 << 20,
    filter_cap=1024,
)


def make(cls: type) -> RemotePolicy:
    return cls(LIMITS, Runner(), node_of=lambda k: "n0")


def test_every_part_is_a_policy_part() -> None:
    parts = RemotePolicy.__bases__
    assert len(parts) == 3 and all(issubclass(p, PolicyPart) for p in parts)
    assert make(RemotePolicy)._next_id() == 1


@pytest.mark.parametrize("missing", ["_fail", "_learn", "_next_id", "_echo_sent"])
def test_a_policy_missing_a_method_its_parts_call_cannot_be_made(missing: str) -> None:
    body = {k: v for k, v in vars(RemotePolicy).items() if k != missing}
    parts = tuple(p for p in RemotePolicy.__bases__ if missing not in vars(p))
    broken = type("Broken", parts, body)
    with pytest.raises(TypeError, match=missing):
        make(broken)


def _resolved(cls: type, name: str) -> object:
    """What ``cls().name`` finds: the first definition in the method order."""
    return next(vars(c)[name] for c in cls.__mro__ if name in vars(c))


@pytest.mark.parametrize("order", list(itertools.permutations(RemotePolicy.__bases__)))
def test_the_parts_order_changes_no_method(order: tuple[type, ...]) -> None:
    body = {k: v for k, v in vars(RemotePolicy).items() if k not in ("__dict__", "__weakref__")}
    reordered = type("Reordered", order, body)
    make(reordered)
    names = {
        n
        for cls in RemotePolicy.__mro__[:-1]  # not object's
        for n, v in vars(cls).items()
        if callable(v) and not n.startswith("__")
    }
    for name in sorted(names):
        found = _resolved(reordered, name)
        assert found is _resolved(RemotePolicy, name), name
        assert not getattr(found, "__isabstractmethod__", False), name
