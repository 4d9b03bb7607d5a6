"""The scheduler side of the vLLM connector (``connector.py``): lookups, holds, leases,
claims and the step's loads.

``ECBrokerScheduler`` is a part the connector holds for the scheduler role (as vLLM's
own Mooncake connector holds an ``ECMooncakeScheduler``); it is given what it reads.
Its promises, per engine step (docs/design.md, "Staged loads"):

- one decision per item and step: the broker's answers are memoised for the step, so
  ``ensure_cache_available``, ``has_cache_item`` and ``update_state_after_alloc`` agree;
- a hit is promised (``has_cache_item`` True) only once every encoder rank reports it
  staged (``stage_book.py``); a staging that fails or passes its hold bound is a miss;
- a request is held (``ensure_cache_available`` False) only for a bounded time: a
  staging (``stage_wait_ms``), a promotion from a lower tier (``max_defer_s``), another
  encoder's claim (``claim_wait_ms``); then its items are encoded here -- never a hang,
  never a wrong answer, at worst an item encoded twice;
- every lease it takes ends when nothing it protects is needed any more (the step's
  end, a settled staging, the request's end), or on its own (``lease_ms``); every claim
  it wins ends with the put, or with the request (``request_finished``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import msgspec
import torch

from lmcache_ec_broker.connector.client import BrokerClient
from lmcache_ec_broker.connector.vllm.meta import (
    ECBrokerConnectorMetadata,
    LoadSpec,
    make_key,
)
from lmcache_ec_broker.connector.vllm.reask import ReaskSchedule
from lmcache_ec_broker.connector.vllm.room_waits import RoomWaits
from lmcache_ec_broker.connector.vllm.stage_book import StageBook, StageState
from lmcache_ec_broker.connector.vllm.stage_link import StageItem
from lmcache_ec_broker.connector.vllm.worker import logger
from lmcache_ec_broker.protocol import EntryInfo, LookupState

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

CLAIM_MS = 30_000  # how long this instance's encode claim holds at most (its put ends it)
# The longest an empty step waits for a worker's stage report while this connector
# holds requests (build_connector_meta says why).
IDLE_STEP_WAIT_S = 0.01
_MISS = EntryInfo(LookupState.MISS)
_T = TypeVar("_T")

# Counters of this part, reported among the connector's stats (meta.STAT_FIELDS).
SCHEDULER_STAT_FIELDS = (
    "ec_hits",
    "ec_misses",
    "ec_deferred",
    "promotion_failures",
    "claim_waits",
    "claim_reasks",
    "claim_timeouts",
)


class SchedulerSettings(msgspec.Struct, frozen=True):
    """What the connector's configuration decides for its scheduler side."""

    encoder_only_producer: bool  # an EPD encoder (--mm-encoder-only): skips, never loads
    fresh: bool  # lookups ask the fleet's store for keys not announced yet
    lease_ms: int  # how long a hit seen is protected from eviction at most
    lookup_wait_ms: int  # the broker answers a lookup within this (half the budget)
    max_defer_s: float  # the longest wait for a promotion from a lower tier
    claims: bool  # this instance claims the items it misses (it stores what it encodes)
    claim_wait_s: float  # the longest wait for another encoder's claim
    stage_wait_s: float  # the hold bound of a staging (stage_book.py)
    probe_interval_s: float  # how often the client probes a broker that did not answer
    reach: int  # how many tokens past its computed ones one step can take a request


@dataclass
class _Waiting:
    """A request deferred until its entries are promoted into the slab."""

    since: float
    hashes: set[str]


class ECBrokerScheduler:
    """The connector's scheduler side (vLLM's scheduler role): created by
    ``ECBrokerConnector`` for that role, which forwards its scheduler hooks here. It
    owns its state: the model field it keys with, the step's memo, leases and loads,
    the requests waiting for promotions or claims, the claims it won, its mirror of
    vLLM's encoder cache, and the stage orders (``book``, None where loads are off).
    What it reads of the connector it is given, as callables: the broker call on a live
    connection, the client if this process has one, the item key policy, the entry
    checks."""

    def __init__(
        self,
        *,
        settings: SchedulerSettings,
        field: str,
        dtype: torch.dtype,
        widths: dict[str, int],
        book: StageBook | None,
        on_live_connection: Callable[[Callable[[BrokerClient], _T]], _T],
        live_client: Callable[[], BrokerClient | None],
        item_key: Callable[[str], str | None],
        mismatch: Callable[[str, list[int], int | None, int | None], str],
        delete_invalid: Callable[[list[tuple[str, str]]], None],
    ) -> None:
        self._settings = settings
        self._dtype = dtype
        self._on_live_connection = on_live_connection
        self._live_client = live_client
        self._item_key = item_key
        self._mismatch = mismatch
        self._delete_invalid = delete_invalid
        # The stage orders, through the engine's staging link (None: no loads here).
        self.book = book
        # The model field it keys with now; "" while unknown (misses, no loads).
        self.field = field
        # The encoder's output width per modality, where vLLM told it.
        self._widths = dict(widths)

        self.ec_hits = 0
        self.ec_misses = 0
        self.ec_deferred = 0  # steps a request waited for a promotion
        self.promotion_failures = 0  # waited for a promotion that did not come: encoded
        self.claim_waits = 0  # steps a request waited for another encoder's claim
        self.claim_timeouts = 0  # ... that did not land within claim_wait_ms: encoded

        # Per step: the broker's answer per mm_hash (memoised so that every hook of the
        # step sees one decision), which answers were counted, and the hashes leased.
        # Across steps: requests waiting for promotions or claims, the claims won, and
        # the stage orders (``book``); they keep their leases until they settle.
        self._step_state: dict[str, int] = {}
        self._counted: set[str] = set()
        self._step_leased: set[str] = set()
        self._waiting: dict[str, _Waiting] = {}
        self._claim_waiting: dict[str, float] = {}  # req_id -> since when it waits
        # Requests whose hits wait for room in the staging budget (room_waits.py).
        self._room = RoomWaits(settings.stage_wait_s)
        self._claimed_by: dict[str, set[str]] = {}  # req_id -> items it claimed
        # When a CLAIMED item is asked about again (reask.py); a broker that does not
        # answer holds the items met in the outage's first two probe intervals, once.
        self._reask = ReaskSchedule(unreached_s=2 * settings.probe_interval_s)
        self._pending_loads: list[LoadSpec] = []
        self._publish: list[str] = []  # this step's items an encoder-only producer skipped
        # A mirror of the mm_hashes vLLM's own encoder cache holds (allocated, not yet
        # reported freed): they are never looked up. vLLM's reset_encoder_cache empties
        # it (encoder_cache_reset, through the engine's wrapped call); should a reset
        # reach vLLM's cache another way, the mirror is stale towards "held" and
        # has_cache_item sees a held hash (vLLM asks only about items it lacks),
        # drops the mirror and stages that item while the scheduler waits (_stage_now).
        self._held: set[str] = set()
        # This step's items _ahead skipped as held: mm_hash -> (embeddings, width)
        self._held_skipped: dict[str, tuple[int, int | None]] = {}

    # ------------------------------------------------------------------ keys, field

    def key(self, mm_hash: str, field: str | None = None) -> str:
        """The broker key of ``mm_hash`` under ``field`` (default: the field now)."""
        field = self.field if field is None else field
        return make_key(field, self._item_key(mm_hash) or mm_hash, self._dtype)

    def _width(self, modality: str) -> int | None:
        return self._widths.get(modality)

    def set_field(self, field: str) -> None:
        """Key with ``field`` from now on ("" = unknown). Called between steps
        (weights_identity.EngineWatch, or the workers' metadata). Leases taken under
        the old field end now: their loads, if any are still to run, are refused by the
        workers (other weights) and encoded instead."""
        old = self.field
        if field == old:
            return
        logger.info(
            "EC broker: model field of the keys is now %s",
            field or "unknown (weights changing: misses until they are fingerprinted)",
        )
        held = self._needed()
        self.field = field
        if self.book is not None:  # orders keyed by the old field: encoded instead
            self.book.clear()
        client = self._live_client()
        if old and held and client is not None:
            try:
                client.unlease([self.key(h, old) for h in held])
            except Exception as exc:  # leases also end on their own (lease_ms)
                logger.warning("EC broker unlease failed: %s", exc)

    def encoder_cache_reset(self) -> None:
        """vLLM's encoder cache was emptied (``EngineCore.reset_encoder_cache``): what
        it held is looked up again and staged like any hit, the request held in
        ``ensure_cache_available`` -- not staged while the whole engine waits."""
        self._held.clear()
        self._held_skipped.clear()

    @property
    def claim_reasks(self) -> int:
        """Lookups of items requests were held on, past the first (reask.py)."""
        return self._reask.reasks

    @property
    def claims_awaited(self) -> int:
        """Items requests are held on now (another encoder claimed them)."""
        return len(self._reask)

    # ------------------------------------------------------------------ staging

    @property
    def stage_timeouts(self) -> int:
        """Stagings whose hold bound passed (a worker did not answer in time)."""
        return self.book.timeouts if self.book is not None else 0

    @property
    def stage_over_budget(self) -> int:
        """Times a hit was held back for lack of room in the staging budget
        (stage_book.py, invariant 4): once per item from the step that first left it
        out until it is staged, encoded instead, or its requests end -- not once per
        step it waits."""
        return self.book.over_budget if self.book is not None else 0

    @property
    def stage_orders(self) -> int:
        """Stage orders open now (staging, or staged and not yet shipped)."""
        return len(self.book) if self.book is not None else 0

    def wait_for_link(self, timeout_s: float) -> bool:
        """Block until every encoder rank's staging link is up, at most ``timeout_s``
        (tests and benchmarks that send a request at once; a served engine's workers
        link long before its first request). True if up (or nothing to link)."""
        book = self.book
        if book is None:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            self._settle(book.refresh())
            left = deadline - time.monotonic()
            if book.ready or left <= 0:
                return book.ready
            book.wait(min(left, 0.05))

    def wait_for_staging(self, timeout_s: float) -> None:
        """Block until every staging ordered so far is settled (staged or failed), at
        most ``timeout_s``: for a caller driving the engine's steps itself (tests,
        benchmarks), which then sees the same steps whatever the link's timing."""
        book = self.book
        if book is None:
            return
        deadline = time.monotonic() + timeout_s
        while book.staging():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            book.wait(left)
            self._settle(book.refresh())

    def close(self) -> None:
        if self.book is not None:
            self.book.close()

    # ------------------------------------------------------------------ vLLM's hooks

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """vLLM >= 0.24, every step before a multimodal request is scheduled: False
        holds the request for a later step while a hit is being staged on the workers
        (bounded: stage_book.py) or an entry promoted from a lower tier (``max_defer_s``);
        never on an encoder-only producer (an item on a lower tier is held by the
        fleet, it need not come here)."""
        if self._settings.encoder_only_producer:
            expected = self._ahead(request, num_computed_tokens)
            ask = [h for h in expected if h not in self._step_state and not self._kept(h)]
            if ask:
                self._lookup(ask, expected, request.request_id)
            return not self._claim_hold(request.request_id, expected)
        book = self.book
        if book is None:  # not a consumer, or loads are off here
            return True
        self._settle(book.refresh())
        expected = self._ahead(request, num_computed_tokens)
        req_id = request.request_id
        if self._room.still_no_room(req_id, expected, book):
            return False
        ask = [
            h
            for h in expected
            if h not in self._step_state and book.state(h) is None and not self._kept(h)
        ]
        if ask:
            self._lookup(ask, expected, req_id)
        if self._claim_hold(req_id, expected):
            return False
        # Hits the broker holds: staged on every encoder rank before they are promised.
        order = [
            StageItem(h, self.key(h), *expected[h])
            for h in expected
            if book.state(h) is not None or self._step_state.get(h) == LookupState.READY
        ]
        staging = False
        if order:
            ordered = book.order(req_id, order)
            for item in order:
                if book.state(item.mm_hash) is not None:
                    continue
                if (
                    ordered
                    and book.held_back(item.mm_hash)
                    and book.room_may_come(req_id, item.num_embeds)
                    and self._room.hold(req_id)
                ):
                    staging = True  # no room yet: the request waits, as for a staging
                else:  # the link is not up, or no room within the bound: encoded
                    self._step_state[item.mm_hash] = LookupState.MISS
        for h in expected:
            state = book.state(h)
            if state is StageState.FAILED:  # could not be staged: encoded, order ended
                book.release({h})
                self._step_state[h] = LookupState.MISS
            elif state is StageState.STAGING:
                staging = True
        waiting = self._waiting.get(req_id)
        if waiting is not None:
            # Waited for these; the broker now says MISS: the promotion failed.
            self.promotion_failures += sum(
                1 for h in waiting.hashes if self._step_state.get(h) == LookupState.MISS
            )
        pending = {h for h in expected if self._step_state.get(h) == LookupState.PENDING}
        if not pending:
            self._waiting.pop(req_id, None)
            return not staging
        now = time.monotonic()
        since = waiting.since if waiting is not None else now
        if now - since >= self._settings.max_defer_s:
            logger.warning(
                "EC broker: %d entr%s of request %s not promoted within %.1f s; encoding instead",
                len(pending),
                "y" if len(pending) == 1 else "ies",
                req_id,
                self._settings.max_defer_s,
            )
            self.promotion_failures += len(pending)
            for h in pending:
                self._step_state[h] = LookupState.MISS
            self._waiting.pop(req_id, None)
            return not staging
        if waiting is None:
            logger.info(
                "EC defer: request %s waits for %s (being promoted into the broker's slab)",
                req_id,
                ", ".join(f"mm_hash={h}" for h in sorted(pending)),
            )
        self._waiting[req_id] = _Waiting(since, pending)
        self.ec_deferred += 1
        return False

    def _kept(self, mm_hash: str) -> bool:
        """A CLAIMED item not due for a re-ask yet (reask.py): CLAIMED for this step."""
        if not self._reask.kept(mm_hash, time.monotonic()):
            return False
        self._step_state[mm_hash] = LookupState.CLAIMED
        return True

    def _claim_hold(self, req_id: str, expected: dict[str, tuple[int, int | None]]) -> bool:
        """Hold the request while another encoder (instance, node) has claimed one of
        its items, at most claim_wait_ms; then those are encoded here (never wrong,
        only duplicated). They are looked up again (with a claim) when the re-ask
        schedule says (reask.py; CLAIMED meanwhile): READY is staged, MISS is ours to
        encode."""
        claimed = [h for h in expected if self._step_state.get(h) == LookupState.CLAIMED]
        if not claimed:
            self._claim_waiting.pop(req_id, None)
            self._reask.forget_request(req_id)
            return False
        self._reask.hold(claimed, req_id)
        now = time.monotonic()
        since = self._claim_waiting.setdefault(req_id, now)
        if now - since < self._settings.claim_wait_s:
            if since == now:
                logger.info(
                    "EC claim: request %s waits for %s (being encoded by another instance)",
                    req_id,
                    ", ".join(f"mm_hash={h}" for h in sorted(claimed)),
                )
            self.claim_waits += 1
            return True
        logger.warning(
            "EC claim: %d item(s) of request %s not encoded elsewhere within %.1f s; "
            "encoding here",
            len(claimed),
            req_id,
            self._settings.claim_wait_s,
        )
        self.claim_timeouts += len(claimed)
        for h in claimed:
            self._step_state[h] = LookupState.MISS
        self._claim_waiting.pop(req_id, None)
        self._reask.forget_request(req_id)
        return False

    def _stage_now(self, mm_hash: str, dims: tuple[int, int | None]) -> None:
        """An item the stale mirror hid from ensure_cache_available (after vLLM's
        reset_encoder_cache, which tells connectors nothing): look it up and stage it
        while the scheduler waits, bounded by the hold bound (once per outage, as any
        staging: stage_book.py). Rare: the first step after a reset, per item."""
        book = self.book
        assert book is not None
        self._lookup([mm_hash], {mm_hash: dims})
        if self._step_state.get(mm_hash) != LookupState.READY:
            return
        if not book.order("", [StageItem(mm_hash, self.key(mm_hash), *dims)]):
            return
        if book.state(mm_hash) is None:
            return  # no room in the staging budget: not ordered
        self.wait_for_staging(self._settings.stage_wait_s)
        if book.state(mm_hash) is not StageState.STAGED:
            book.release({mm_hash})

    def _settle(self, settled: set[str]) -> None:
        """Stagings that ended (staged or failed) need their broker leases no more:
        a staged tensor is on every encoder rank, a failed one is encoded."""
        if settled:
            self._step_leased -= settled
            self._unlease(settled)

    def _ahead(
        self, request: Request, num_computed_tokens: int
    ) -> dict[str, tuple[int, int | None]]:
        """The request's items this step may need, to look up: mm_hash -> (embeddings,
        the encoder's output width if known)."""
        expected: dict[str, tuple[int, int | None]] = {}
        reach = num_computed_tokens + self._settings.reach
        for index, feature in enumerate(request.mm_features):
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # already in the KV cache: no encoder output needed
            if pos.offset >= reach:
                continue  # not in this step's reach
            if feature.identifier in self._held:
                # vLLM's own encoder cache has it: never looked up nor leased (noted,
                # in case the mirror is stale: has_cache_item)
                self._held_skipped[feature.identifier] = (
                    num_embeds(request, index),
                    self._width(feature.modality),
                )
                continue
            if self._item_key(feature.identifier) is None:
                continue  # a private identifier, a tower LoRA adapter's item: never asked
            if feature.identifier not in expected:
                width = self._width(feature.modality)
                expected[feature.identifier] = (num_embeds(request, index), width)
        return expected

    def _lookup(
        self,
        hashes: list[str],
        expected: dict[str, tuple[int, int | None]],
        req_id: str | None = None,
    ) -> None:
        """One batched lookup with a lease; memoises a state per hash for the step."""
        if not self.field:  # weights changing: no field to key with yet
            for mm_hash in hashes:
                self._step_state[mm_hash] = LookupState.MISS
            return
        settings = self._settings
        keys = [self.key(h) for h in hashes]
        # An encoder-only producer never loads: nothing to protect from eviction.
        lease_ms = 0 if settings.encoder_only_producer else settings.lease_ms
        claim_ms = CLAIM_MS if settings.claims else 0
        try:
            infos = self._on_live_connection(
                lambda c: c.lookup(
                    keys,
                    lease_ms=lease_ms,
                    wait_ms=settings.lookup_wait_ms,
                    fresh=settings.fresh,
                    claim_ms=claim_ms,
                )
            )
        except Exception as exc:  # never take the scheduler down
            logger.warning("EC broker lookup failed: %s", exc)
            infos = [_MISS] * len(hashes)
        # A broker that did not answer within the budget (the circuit is open) answers
        # MISS without asking (BrokerClient.lookup): for a request's item that is
        # "unknown", not "ours to encode": early in the outage it is held like a
        # CLAIMED one -- a lookup past the budget is most often a busy broker, and
        # another instance may be encoding the item (reask.py, 3). A broker that is
        # gone (refused, reset) holds no claim anyone waits for: MISS is ours.
        client = self._live_client()
        unreached = claim_ms > 0 and client is not None and client.tripped
        bad: list[tuple[str, str]] = []
        now = time.monotonic()
        for mm_hash, info in zip(hashes, infos, strict=True):
            state = info.state
            if state in (LookupState.READY, LookupState.PENDING):
                if lease_ms:
                    self._step_leased.add(mm_hash)
                embeds, width = expected.get(mm_hash, (None, None))
                why = self._mismatch(info.dtype, info.shape, embeds, width)
                if why:
                    bad.append((mm_hash, why))
                    state = LookupState.MISS
            elif state == LookupState.CLAIMED and claim_ms:
                pass  # another encoder is on it: the request waits (_claim_hold)
            elif unreached and req_id is not None and self._reask.unreached(mm_hash, now):
                self._step_state[mm_hash] = LookupState.CLAIMED  # held a bounded time more
                continue
            else:
                if claim_ms and state == LookupState.MISS and req_id is not None:
                    self._claimed_by.setdefault(req_id, set()).add(mm_hash)  # ours now
                state = LookupState.MISS  # including states a newer broker may invent
            self._step_state[mm_hash] = state
            if claim_ms and req_id is not None and not unreached:
                self._reask.answered(mm_hash, state == LookupState.CLAIMED, now)
        if bad:
            self._delete_invalid(bad)

    def has_cache_item(self, identifier: str) -> bool:
        producer = self._settings.encoder_only_producer
        book = self.book
        if not producer and book is None:
            return False
        stale = identifier in self._held
        if stale:
            # vLLM asks only about items its encoder cache lacks: the mirror is stale
            # (reset_encoder_cache), so forget it; it refills from the allocations.
            self._held.clear()
        if producer:
            if self._item_key(identifier) is None:
                self._step_state[identifier] = LookupState.MISS
            if identifier not in self._step_state:
                self._lookup([identifier], {})
            # A producer skips what the fleet holds anywhere.
            state = self._step_state[identifier]
            answer = state in (LookupState.READY, LookupState.PENDING)
        else:
            # A consumer promises only what every encoder rank holds staged (an item
            # ensure_cache_available did not order, or that failed, is encoded).
            assert book is not None
            dims = self._held_skipped.get(identifier)
            if stale and dims is not None and book.state(identifier) is None:
                self._stage_now(identifier, dims)
            answer = book.state(identifier) is StageState.STAGED
        if identifier not in self._counted:
            self._counted.add(identifier)
            if answer:
                self.ec_hits += 1
            else:
                self.ec_misses += 1
        return answer

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        # Also called for items the scheduler chose to encode locally: only the
        # ones has_cache_item answered True for this step are external loads.
        mm_hash = request.mm_features[index].identifier
        self._held.add(mm_hash)  # encoded or loaded, vLLM's encoder cache now has it
        if self._settings.encoder_only_producer:
            if self._step_state.get(mm_hash) in (LookupState.READY, LookupState.PENDING):
                self._publish.append(mm_hash)  # skipped: its workers publish it
            return
        book = self.book
        if book is None:
            return
        book.allocated(mm_hash)  # not held back for lack of room any more
        if book.state(mm_hash) is not StageState.STAGED:
            return
        if any(spec.mm_hash == mm_hash for spec in self._pending_loads):
            return  # one load per item and step
        modality = request.mm_features[index].modality
        self._pending_loads.append(
            LoadSpec(
                request.request_id,
                mm_hash,
                num_embeds(request, index),
                self._width(modality),
                index,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECBrokerConnectorMetadata:
        # Every vLLM with EC connectors passes its SchedulerOutput here. Every load goes
        # out, even one whose request was preempted later in the step: its tensor
        # moves into the encoder cache (vLLM holds the item) and its order ends.
        self._held.difference_update(getattr(scheduler_output, "free_encoder_mm_hashes", ()))
        self._idle_step_wait(scheduler_output)
        self._room.step_ended()
        meta = ECBrokerConnectorMetadata(
            loads=self._pending_loads,
            model=self.field,
            publish=self._publish,
        )
        self._publish = []
        if self.book is not None:
            for spec in self._pending_loads:
                self.book.shipped(spec.mm_hash)
            # _stage_now's orders were for this step's has_cache_item only: one vLLM
            # did not allocate after all is released here, not held until a reset.
            self.book.forget_request("")
        leased = self._step_leased
        self._pending_loads = []
        self._step_state = {}
        self._counted = set()
        self._step_leased = set()
        self._held_skipped = {}
        # Hits not staging (the request was not scheduled after all, the item was in
        # vLLM's own encoder cache, a wrong entry, staged already) protect nothing.
        self._unlease(leased)
        return meta

    def _idle_step_wait(self, scheduler_output: SchedulerOutput) -> None:
        """A step that schedules nothing while this connector holds requests (staging,
        a promotion, another instance's encode) waits here for the first stage report,
        at most IDLE_STEP_WAIT_S. Without it vLLM's engine core steps again at once, as
        long as the hold lasts: thousands of empty steps a second, each broadcast to
        every worker. On a loaded host that loop took the CPUs from every other process
        -- the broker included, which then could not answer the very staging the
        requests waited for (TP 2 beside CPU-bound processes: both ranks' Gets
        unanswered for the whole worker budget, every hit encoded; 2026-12-06, kernel
        6.18). A report ends the wait at once, so a staged hit is not delayed; new
        requests reach an otherwise idle engine at most IDLE_STEP_WAIT_S later."""
        if getattr(scheduler_output, "total_num_scheduled_tokens", 1):
            return
        book = self.book
        if book is not None and len(book.staging()) > 0:
            book.wait(IDLE_STEP_WAIT_S)
        elif self._waiting or self._claim_waiting or self._room.held_now:
            time.sleep(IDLE_STEP_WAIT_S)

    def _needed(self) -> set[str]:
        needed = set(self.book.staging()) if self.book is not None else set()
        needed |= self._step_leased
        for waiting in self._waiting.values():
            needed |= waiting.hashes
        return needed

    def _unlease(self, hashes: set[str]) -> None:
        done = hashes - self._needed()
        if not done or not self.field:  # "": nothing was leased under a field
            return
        client = self._live_client()
        if client is None:
            return
        try:
            client.unlease([self.key(h) for h in done])
        except Exception as exc:  # leases also end on their own (lease_ms)
            logger.warning("EC broker unlease failed: %s", exc)

    def request_finished(self, request: Request) -> None:
        self._claim_waiting.pop(request.request_id, None)
        self._room.forget(request.request_id)
        self._reask.forget_request(request.request_id)
        claimed = self._claimed_by.pop(request.request_id, None)
        client = self._live_client()
        if claimed and self.field and client is not None:
            # a claim whose put landed is gone already; one of an aborted request is
            # let go so that no other instance waits for an encode that will not come
            try:
                client.unclaim([self.key(h) for h in claimed])
            except Exception as exc:  # claims also end on their own (CLAIM_MS)
                logger.warning("EC broker unclaim failed: %s", exc)
        waiting = self._waiting.pop(request.request_id, None)
        if waiting is not None:  # aborted or failed while waiting for a promotion
            self._unlease(waiting.hashes)
        if self.book is not None:  # its stagings no other request waits for end
            before = self.book.staging()
            self.book.forget_request(request.request_id)
            self._unlease(before - self.book.staging())


def num_embeds(request: Request, index: int) -> int:
    for name in ("get_num_encoder_embeds", "get_num_encoder_tokens"):
        method = getattr(request, name, None)
        if method is not None:
            return int(method(index))
    return int(request.mm_features[index].mm_position.length)
