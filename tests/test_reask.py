"""The re-ask schedule of CLAIMED items (connector/vllm/reask.py): pure state, times given."""

from __future__ import annotations

import pytest

from lmcache_ec_broker.connector.vllm.reask import ReaskSchedule


def test_a_claimed_item_is_kept_then_due_at_growing_bounded_intervals():
    s = ReaskSchedule(first_s=0.005, growth=2.0, max_s=0.040)
    assert not s.kept("x", 0.0), "an item never answered is asked"
    s.answered("x", True, 0.0)
    s.hold(["x"], "r")
    asks = [0.0]
    t = 0.0
    while t < 1.0:  # a step every millisecond for a second
        t = round(t + 0.001, 6)
        if not s.kept("x", t):
            asks.append(t)
            s.answered("x", True, t)
    gaps = [round(b - a, 3) for a, b in zip(asks[:-1], asks[1:], strict=True)]
    want = [0.005, 0.01, 0.02] + [0.04] * (len(gaps) - 3)
    # each gap is its interval, or one step more (the step after it fell due)
    assert all(w <= g <= w + 0.001 for g, w in zip(gaps, want, strict=True)), gaps
    assert 1 + 3 + 23 <= len(asks) <= 1 + 3 + 25, asks  # not one per step (1000)
    assert s.reasks == len(asks) - 1


def test_any_other_answer_drops_it():
    s = ReaskSchedule()
    s.answered("x", True, 0.0)
    s.hold(["x"], "r")
    assert s.kept("x", 0.001)
    assert not s.kept("x", 1.0)
    s.answered("x", False, 1.0)  # READY (or MISS: ours now)
    assert len(s) == 0 and not s.kept("x", 1.0001)


def test_released_when_no_held_request_waits_for_it():
    s = ReaskSchedule()
    for h in ("x", "y"):
        s.answered(h, True, 0.0)
    s.hold(["x", "y"], "a")
    s.hold(["x"], "b")
    s.forget_request("a")  # aborted, finished or stopped waiting
    assert len(s) == 1 and s.kept("x", 0.001) and not s.kept("y", 0.001)
    s.forget_request("b")
    assert len(s) == 0


@pytest.mark.parametrize(
    "args", [(0, 2, 0.04), (0.05, 2, 0.04), (0.005, 0.5, 0.04), (0.005, 2, 0.04, -1)]
)
def test_bad_bounds_refused(args):
    with pytest.raises(ValueError, match="re-ask schedule"):
        ReaskSchedule(*args)


def test_an_unanswered_re_ask_keeps_it_a_bounded_time_only():
    s = ReaskSchedule(unreached_s=1.0)
    s.answered("x", True, 0.0)
    s.hold(["x"], "r")
    assert s.unreached("x", 0.1), "the first unanswered re-ask keeps it CLAIMED"
    assert s.kept("x", 0.101), "and it is not due again at once"
    assert s.unreached("x", 1.0), "still within 1 s of the first unanswered re-ask"
    assert not s.unreached("x", 1.1), "past the bound: it leaves, encoded here"
    assert len(s) == 0


def test_an_outage_holds_the_items_met_early_in_it_once():
    """Invariant 3: a first lookup the broker did not answer holds its item too (the
    broker is most likely busy and another encoder may be on it), within the
    outage's first unreached_s only; later in the same outage items are encoded at
    once, so a dead broker costs one bounded wait per outage, not one per request."""
    s = ReaskSchedule(unreached_s=1.0)
    assert s.unreached("x", 0.0), "met as the outage starts: held"
    s.hold(["x"], "r1")
    assert s.kept("x", 0.001) and not s.kept("x", 0.006), "re-asked on the schedule"
    assert s.unreached("x", 0.5) and s.unreached("y", 0.9), "within the outage's first 1 s"
    s.hold(["y"], "r2")
    assert not s.unreached("x", 1.0) and not s.unreached("y", 1.0), "the outage is 1 s old"
    assert not s.unreached("z", 5.0), "later in the same outage: encoded at once"
    assert len(s) == 0
    s.answered("z", False, 6.0)  # the broker answers: the outage is over
    assert s.unreached("w", 7.0), "a new outage holds again"


def test_an_answer_between_unanswered_re_asks_restarts_the_bound():
    s = ReaskSchedule(unreached_s=1.0)
    s.answered("x", True, 0.0)
    s.hold(["x"], "r")
    assert s.unreached("x", 0.5)
    s.answered("x", True, 1.2)  # the broker answered again: still CLAIMED
    assert s.unreached("x", 2.0) and s.unreached("x", 2.9)
    assert not s.unreached("x", 3.0)
