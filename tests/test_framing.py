"""protocol.FrameReader / frame_length: the one frame parser (broker and client)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ec_broker.protocol import (
    FRAME_HEADER,
    FrameReader,
    Has,
    ProtocolError,
    Request,
    encode_frame,
    frame_length,
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.text(max_size=20), max_size=5), min_size=1, max_size=8),
    st.lists(st.integers(1, 64), min_size=1, max_size=50),
)
def test_any_split_of_the_stream_yields_the_same_frames(batches, cuts):
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(Request)
    msgs = [Has(keys) for keys in batches]
    stream = b"".join(encode_frame(enc, m) for m in msgs)
    reader = FrameReader(1 << 20)
    got = []
    pos = 0
    i = 0
    while pos < len(stream):
        n = cuts[i % len(cuts)]
        reader.feed(stream[pos : pos + n])
        pos += n
        i += 1
        while (body := reader.next_frame()) is not None:
            got.append(dec.decode(body))
    assert got == msgs and len(reader) == 0


def test_an_oversized_frame_is_refused_from_its_header_alone():
    reader = FrameReader(100)
    reader.feed(FRAME_HEADER.pack(101))  # no body sent at all
    with pytest.raises(ProtocolError, match="101 bytes exceeds the maximum of 100"):
        reader.next_frame()
    assert frame_length(FRAME_HEADER.pack(100), 100) == 100
    with pytest.raises(ProtocolError):
        frame_length(b"\0\0" + FRAME_HEADER.pack(7), 6, offset=2)
