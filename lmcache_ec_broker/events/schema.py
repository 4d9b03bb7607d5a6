"""The residency event schema (version ``SCHEMA_VERSION``; docs/events.md is the reference).

Wire format, as vLLM's KV events (``vllm/distributed/kv_events.py``):

- PUB socket, multipart ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian
  sequence number (one counter per broker start, from 0, +1 per message);
  ``payload`` a msgpack ``EventBatch`` encoded as an array ``[ts, events,
  data_parallel_rank?]``; each event a map with a ``type`` field naming it.
- ROUTER replay socket: a request of 8 bytes (big-endian start seq) is answered
  with every buffered ``(topic, seq, payload)`` from there, then ``(b"", -1, b"")``.
  Any other request body is a msgpack ``SnapshotRequest``, answered with one
  ``(topic, next_seq, Snapshot)`` message: the state after every batch before
  ``next_seq``.

Topics: ``encoder-cache/v<version>/<node>/<model>``; node-wide batches (heartbeat,
cleared) use an empty model: ``encoder-cache/v1/<node>/``.
"""

from __future__ import annotations

import msgspec

SCHEMA_VERSION = 1
TOPIC_ROOT = "encoder-cache"
TOPIC_PREFIX = f"{TOPIC_ROOT}/v{SCHEMA_VERSION}/"
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# Tier names, nearest first; ``medium`` in vLLM's vocabulary for each.
TIERS = ("slab", "disk", "remote")
MEDIUM = {"slab": "CPU", "disk": "STORAGE", "remote": "REMOTE"}


class ResidencyEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the events; encoded as a map whose ``type`` names the class."""


class EncoderCacheStored(ResidencyEvent):
    """``mm_hash`` of ``model`` (the key's model field) is now held on ``tier``."""

    mm_hash: str
    model: str
    dtype: str
    tier: str
    nbytes: int
    medium: str | None = None


class EncoderCacheRemoved(ResidencyEvent):
    """``mm_hash`` of ``model`` left ``tier`` (evicted, deleted or cleared)."""

    mm_hash: str
    model: str
    dtype: str
    tier: str
    medium: str | None = None


class EncoderCacheCleared(ResidencyEvent):
    """Everything on ``tier`` is gone; ``tier`` None: on every tier (the broker stops)."""

    tier: str | None = None


class Heartbeat(ResidencyEvent, omit_defaults=False):
    """Sent every ``events_heartbeat_s``; a new ``epoch`` means the broker restarted.
    Always encodes ``schema_version`` (the base's ``omit_defaults`` would drop it: it
    is the default); a heartbeat without it still decodes, as version 1."""

    epoch: str
    schema_version: int = SCHEMA_VERSION


Event = EncoderCacheStored | EncoderCacheRemoved | EncoderCacheCleared | Heartbeat


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Same layout as vLLM's ``EventBatch``: ``[ts, events, data_parallel_rank?]``."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class SnapshotRequest(msgspec.Struct, tag=True):
    """Ask the replay socket for the current state."""


class Snapshot(msgspec.Struct):
    """A broker's residency after every batch with a sequence number below ``next_seq``."""

    schema_version: int
    node: str
    epoch: str
    next_seq: int
    entries: list[EncoderCacheStored]


def topic(node: str, model: str = "") -> str:
    return f"{TOPIC_PREFIX}{node}/{model}"


def parse_topic(raw: bytes) -> tuple[str, str] | None:
    """``(node, model)`` of a topic of this schema version; None for anything else."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not text.startswith(TOPIC_PREFIX):
        return None
    node, sep, model = text[len(TOPIC_PREFIX) :].partition("/")
    return (node, model) if sep and node else None


def split_key(key: str) -> tuple[str, str, str] | None:
    """``(model, mm_hash, dtype)`` of a connector key ``<model>@1@0@<mm_hash>@<dtype>``;
    None for a key of another shape (published as nothing: a router cannot ask for it)."""
    parts = key.rsplit("@", 4)
    if len(parts) != 5:
        return None
    model, world, worker, mm_hash, dtype = parts
    if not (model and mm_hash and dtype and world.isdigit() and worker.isdigit()):
        return None
    return model, mm_hash, dtype


def model_matches(asked: str, model: str) -> bool:
    """A lookup's model names the key's model field exactly, or its part before the
    fingerprint (``<model>#<fingerprint>``): routers know the served model, not the hash."""
    return asked == model or model.partition("#")[0] == asked


encoder = msgspec.msgpack.Encoder()
batch_decoder = msgspec.msgpack.Decoder(EventBatch)
snapshot_decoder = msgspec.msgpack.Decoder(Snapshot)
request_decoder = msgspec.msgpack.Decoder(SnapshotRequest)
