"""The remote value format, URL parsing and circuit breaker (no servers needed)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_ec_broker.broker.tiers.redis.resp import key_slot
from lmcache_ec_broker.broker.tiers.remote import value as rv
from lmcache_ec_broker.broker.tiers.remote.circuit import BreakerState, CircuitBreaker
from lmcache_ec_broker.remote_url import mask_url, parse_remote_url

KEY = "model@1@0@abc@bfloat16"
LIMIT = 1 << 30


def _parse_all(value: bytes, key: str = KEY, hmac_key: bytes | None = None) -> bytes:
    """What the tier does: header check, then streamed checksum; returns the payload."""
    h = rv.parse_header(value, key, LIMIT, hmac_key, total_len=len(value))
    payload = value[h.size :]
    v = rv.Verifier(h)
    v.update(payload)
    v.finish()
    return payload


def test_roundtrip_every_dtype() -> None:
    from lmcache_ec_broker.protocol import DTYPE_ITEMSIZE

    for dtype, item in DTYPE_ITEMSIZE.items():
        payload = os.urandom(3 * 5 * item)
        value = rv.encode_value(KEY, dtype, [3, 5], payload)
        h = rv.parse_header(value, KEY, LIMIT, total_len=len(value))
        assert (h.dtype, h.shape, h.nbytes) == (dtype, (3, 5), len(payload))
        assert _parse_all(value) == payload


def test_blake2b_values_read_and_written() -> None:
    value = rv.encode_value(KEY, "uint8", [4], b"abcd", algo=rv.ALGO_BLAKE2B)
    assert _parse_all(value) == b"abcd"


def test_unsigned_values_use_xxh3_and_signed_ones_blake3() -> None:
    assert rv.default_algo(None) == rv.ALGO_XXH3_128
    assert rv.default_algo(b"k" * 32) == rv.ALGO_BLAKE3
    payload = os.urandom(4096)
    unsigned = rv.encode_value(KEY, "uint8", [4096], payload)
    assert rv.parse_header(unsigned, KEY, LIMIT).algo == rv.ALGO_XXH3_128
    assert _parse_all(unsigned) == payload
    # Values written before xxh3 (blake3) still read.
    old = rv.encode_value(KEY, "uint8", [4096], payload, algo=rv.ALGO_BLAKE3)
    assert _parse_all(old) == payload
    flipped = bytearray(unsigned)
    flipped[-100] ^= 0x10
    with pytest.raises(rv.BadValue, match="checksum"):
        _parse_all(bytes(flipped))


def test_signed_value_over_xxh3_is_refused() -> None:
    """xxh3 is not collision-resistant: a MAC over it would not bind the payload."""
    key = os.urandom(32)
    weak = rv.encode_value(KEY, "uint8", [8], b"12345678", hmac_key=key, algo=rv.ALGO_XXH3_128)
    with pytest.raises(rv.BadValue, match="non-cryptographic checksum"):
        _parse_all(weak, hmac_key=key)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda v: v[:10], "shorter than a header"),
        (lambda v: v[:-1], "truncated or has trailing"),
        (lambda v: v + b"x", "truncated or has trailing"),
        (lambda v: b"XXXX" + v[4:], "bad magic"),
        (lambda v: v[:4] + struct.pack("<H", 9) + v[6:], "version 9"),
        (lambda v: v[:6] + struct.pack("<H", 4) + v[8:], "flags"),
        (lambda v: v[:8] + b"\x07" + v[9:], "checksum algorithm"),
    ],
)
def test_bad_headers_are_refused(mutate, needle) -> None:
    value = rv.encode_value(KEY, "float32", [4], os.urandom(16))
    with pytest.raises(rv.BadValue, match=needle):
        _parse_all(mutate(value))


def test_payload_flip_fails_checksum() -> None:
    value = bytearray(rv.encode_value(KEY, "float32", [64], os.urandom(256)))
    value[-7] ^= 1
    with pytest.raises(rv.BadValue, match="checksum"):
        _parse_all(bytes(value))


def test_other_key_and_size_limits_refused() -> None:
    value = rv.encode_value(KEY, "float32", [4], os.urandom(16))
    with pytest.raises(rv.BadValue, match="another key"):
        _parse_all(value, key="other")
    with pytest.raises(rv.BadValue, match="exceeds the limit"):
        rv.parse_header(value, KEY, 8)
    lie = rv.encode_header(KEY, "float32", [5], b"\0" * 32, 16, rv.ALGO_BLAKE2B)
    with pytest.raises(rv.BadValue, match="does not match dtype"):
        rv.parse_header(lie + b"\0" * 16, KEY, LIMIT)
    bad_dtype = rv.encode_header(KEY, "qint8", [4], b"\0" * 32, 4, rv.ALGO_BLAKE2B)
    with pytest.raises(rv.BadValue, match="quantized"):
        rv.parse_header(bad_dtype + b"\0" * 4, KEY, LIMIT)


def test_hmac_required_and_checked() -> None:
    key = os.urandom(32)
    payload = os.urandom(32)
    signed = rv.encode_value(KEY, "uint8", [32], payload, hmac_key=key)
    assert _parse_all(signed, hmac_key=key) == payload
    assert _parse_all(signed) == payload  # no key configured: the checksum still holds
    unsigned = rv.encode_value(KEY, "uint8", [32], payload)
    with pytest.raises(rv.BadValue, match="not signed"):
        _parse_all(unsigned, hmac_key=key)
    with pytest.raises(rv.BadValue, match="signature"):
        _parse_all(
            rv.encode_value(KEY, "uint8", [32], payload, hmac_key=os.urandom(32)), hmac_key=key
        )
    # A hostile writer re-checksums a changed payload but cannot re-sign it.
    forged = rv.encode_value(KEY, "uint8", [32], os.urandom(32))
    h = rv.parse_header(signed, KEY, LIMIT)
    tampered = signed[: rv.FIXED.size - 32] + forged[rv.FIXED.size - 32 : rv.FIXED.size]
    tampered += signed[rv.FIXED.size : h.size] + forged[-32:]
    with pytest.raises(rv.BadValue, match="signature"):
        _parse_all(tampered, hmac_key=key)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_fuzz_random_bytes_never_crash(data: bytes) -> None:
    try:
        _parse_all(data)
    except rv.BadValue:
        pass


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_fuzz_mutated_values_refused_or_identical(data: st.DataObject) -> None:
    payload = data.draw(st.binary(min_size=4, max_size=64).filter(lambda b: len(b) % 4 == 0))
    value = bytearray(rv.encode_value(KEY, "float32", [len(payload) // 4], payload))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(value) - 1))
        value[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(value)))
    mutated = bytes(value[:cut])
    try:
        got = _parse_all(mutated)
    except rv.BadValue:
        return
    assert got == payload  # anything accepted is exactly what was stored


def test_reader_without_blake3_reads_blake2b_and_refuses_blake3_cleanly() -> None:
    code = (
        "import sys; sys.modules['blake3'] = None\n"
        "from lmcache_ec_broker.broker.tiers.remote import value as rv\n"
        "assert rv.default_algo(b'key') == rv.ALGO_BLAKE2B\n"
        "v = rv.encode_value('k', 'uint8', [3], b'abc', algo=rv.default_algo(b'key'))\n"
        "h = rv.parse_header(v, 'k', 100, total_len=len(v)); x = rv.Verifier(h); x.update(v[h.size:]); x.finish()\n"
        "v3 = bytes.fromhex(sys.argv[1])\n"
        "try:\n"
        "    rv.Verifier(rv.parse_header(v3, 'k', 100))\n"
        "except rv.BadValue as e: print('refused', e)\n"
    )
    v3 = rv.encode_value("k", "uint8", [3], b"abc", algo=rv.ALGO_BLAKE3)
    out = subprocess.run(
        [sys.executable, "-c", code, v3.hex()], capture_output=True, text=True, check=True
    )
    assert "refused" in out.stdout and "blake3" in out.stdout


# ---------------------------------------------------------------- URLs


def test_urls() -> None:
    t = parse_remote_url("redis://:pw@10.0.0.1:7000/3")
    assert (t.hosts, t.db, t.password, t.tls, t.cluster) == (
        [("10.0.0.1", 7000)],
        3,
        "pw",
        False,
        False,
    )
    assert parse_remote_url("rediss://h").tls
    assert parse_remote_url("valkey://h:1").hosts == [("h", 1)]
    t = parse_remote_url("unix://:pw@/run/redis.sock?db=2")
    assert (t.unix_path, t.db, t.password) == ("/run/redis.sock", 2, "pw")
    t = parse_remote_url("redis://a:1,b:2")
    assert t.cluster and t.hosts == [("a", 1), ("b", 2)]
    assert parse_remote_url("redis-cluster://a:1").cluster
    for bad in ("http://h", "redis://h:x", "redis://a:1,b:2/1", "unix://relative", "h:1"):
        with pytest.raises(ValueError):
            parse_remote_url(bad)
    assert "pw" not in mask_url("redis://u:pw@h:1/0") and "u:***@" in mask_url("redis://u:pw@h:1/0")
    assert "pw" not in mask_url("unix://:pw@/run/r.sock")
    with pytest.raises(ValueError) as info:
        parse_remote_url("redis://:topsecret@h:nope")
    assert "topsecret" not in str(info.value)


def test_key_slot_matches_redis() -> None:
    # Known values from the Redis Cluster specification / CLUSTER KEYSLOT.
    assert key_slot(b"123456789") == 12739
    assert key_slot(b"{user1000}.following") == key_slot(b"{user1000}.followers")
    assert key_slot(b"foo{}{bar}") == key_slot(b"foo{}{bar}")


# ---------------------------------------------------------------- circuit breaker


def test_circuit_opens_backs_off_and_recovers() -> None:
    now = [0.0]
    changes: list[BreakerState] = []
    cb = CircuitBreaker(
        threshold=2,
        backoff_s=1.0,
        max_backoff_s=4.0,
        clock=lambda: now[0],
        on_change=changes.append,
    )
    assert cb.allow()
    cb.failure()
    assert cb.up
    cb.failure()
    assert cb.state is BreakerState.OPEN and not cb.allow()
    now[0] = 1.0
    assert cb.allow()  # the one probe
    assert not cb.allow()  # others wait for it
    cb.failure()  # probe failed: backoff doubles
    assert cb.state is BreakerState.OPEN
    now[0] = 2.5
    assert not cb.allow()
    now[0] = 3.0
    assert cb.allow()
    cb.success()
    assert cb.up and cb.allow()
    assert changes == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED]


def test_circuit_probe_that_never_reports_expires() -> None:
    now = [0.0]
    cb = CircuitBreaker(threshold=1, backoff_s=1.0, max_backoff_s=4.0, clock=lambda: now[0])
    cb.failure()
    now[0] = 1.0
    assert cb.allow()  # a probe whose caller then fails before reaching the store
    now[0] = 4.0
    assert not cb.allow()
    now[0] = 5.5
    assert cb.allow()  # not stuck half-open
    cb.success()
    assert cb.up


# ---------------------------------------------------------------- configuration


def test_remote_config_layers_and_errors(tmp_path, monkeypatch) -> None:
    from lmcache_ec_broker.config_sources import load_config

    for var in [v for v in os.environ if v.startswith("LMCACHE_EC_")]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    yml = tmp_path / "c.yaml"
    yml.write_text(
        "remote_url: redis://plain:1\nec_remote_url: redis://prefixed:2\nremote_ttl_s: 60\n"
    )
    cfg, src = load_config({}, str(yml))
    assert cfg.remote_url == "redis://prefixed:2" and "ec_remote_url" in src["remote_url"]
    assert cfg.remote_ttl_s == 60
    monkeypatch.setenv("LMCACHE_EC_REMOTE_URL", "unix:///run/r.sock")
    monkeypatch.setenv("LMCACHE_EC_REMOTE_TIMEOUT_S", "2.5")
    cfg, src = load_config({}, str(yml))
    assert cfg.remote_url == "unix:///run/r.sock" and cfg.remote_timeout_s == 2.5
    assert src["remote_url"] == "env LMCACHE_EC_REMOTE_URL"
    cfg, _ = load_config({"remote_url": "redis://cli:3"}, str(yml))
    assert cfg.remote_url == "redis://cli:3"
    monkeypatch.delenv("LMCACHE_EC_REMOTE_URL")
    monkeypatch.delenv("LMCACHE_EC_REMOTE_TIMEOUT_S")
    bad = {
        "remote_url: 'http://x'": "not supported",
        "remote_url: redis://h:1\nremote_timeout_s: 0": "remote_timeout_s",
        "remote_url: redis://h:1\nremote_password_file: /nonexistent/pw": "remote_password_file",
        "remote_url: redis://h:1\nremote_hmac_key_file: /nonexistent/k": "remote_hmac_key_file",
        "remote_url: redis://h:1\nremote_write_queue: 0": "remote_write_queue",
        "remote_url: redis://h:1\nremote_key_prefix: 'a b'": "remote_key_prefix",
        "remote_url: 'redis://:hunter2@h:nope'": "port",
    }
    for text, needle in bad.items():
        yml.write_text(text + "\n")
        with pytest.raises(ValueError, match=needle) as info:
            load_config({}, str(yml))
        assert "hunter2" not in str(info.value)
    short = tmp_path / "short.key"
    short.write_text("tooshort")
    yml.write_text(f"remote_url: redis://h:1\nremote_hmac_key_file: {short}\n")
    with pytest.raises(ValueError, match="at least 16"):
        load_config({}, str(yml))
    # Off by default: nothing about the remote tier is checked or started.
    yml.write_text("remote_timeout_s: 0\n")
    cfg, _ = load_config({}, str(yml))
    assert cfg.remote_url is None
