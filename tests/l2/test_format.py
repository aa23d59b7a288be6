"""Tests for kvd.l2.format: header round trips and every HeaderError path."""

from __future__ import annotations

import struct

import pytest

from kvd.checksum import checksum
from kvd.l2.format import (
    BLOCK_BYTES,
    FLAG_TOMBSTONE,
    HEADER_BYTES_MAX,
    MAGIC,
    RECORD_ALIGN_BYTES,
    HeaderError,
    RecordHeader,
    align_up,
    decode,
    header_bytes_at,
)


def header(**changes: object) -> RecordHeader:
    fields: dict[str, object] = {
        "namespace": "model=llama;tp=0/2",
        "key": bytes(range(32)),
        "parent": bytes(range(32, 64)),
        "meta": b'{"shape":[2,16]}',
        "generation": 0x1234_5678_9ABC_DEF1,
        "seq": 77,
        "payload_bytes": 1 << 20,
        "payload_checksum": 0xFEED_FACE_CAFE_BEEF,
    }
    fields.update(changes)
    return RecordHeader(**fields)  # type: ignore[arg-type]


def reseal(data: bytearray) -> bytes:
    """Recompute the header checksum after editing fields, as a forger would."""
    size = len(data)
    struct.pack_into("<Q", data, size - 8, checksum(bytes(data[: size - 8])))
    return bytes(data)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"namespace": "", "key": b"k", "parent": b"", "meta": b"", "payload_bytes": 0},
        {"namespace": "ü-名前", "flags": FLAG_TOMBSTONE},
        {"meta": bytes(4096)},  # a 4 KiB meta needs the 8 KiB header
        {"key": bytes(64), "parent": bytes(64), "payload_bytes": 64 * 1024 * 1024 + 3},
        {"generation": (1 << 64) - 1, "seq": (1 << 64) - 1},
    ],
)
def test_round_trip(changes: dict[str, object]) -> None:
    original = header(**changes)
    data = original.encode()
    assert len(data) == original.header_bytes
    assert data[:8] == MAGIC
    assert header_bytes_at(data) == original.header_bytes
    assert decode(data) == original
    # Trailing bytes (the payload) do not disturb decoding.
    assert decode(data + b"\xff" * 100) == original


def test_sizes() -> None:
    small = header(meta=b"")
    assert small.header_bytes == BLOCK_BYTES
    assert header(meta=bytes(4096)).header_bytes == HEADER_BYTES_MAX
    # A payload that ends exactly on 64 KiB costs one more 64 KiB for the header.
    exact = header(meta=b"", payload_bytes=RECORD_ALIGN_BYTES)
    assert exact.record_bytes == 2 * RECORD_ALIGN_BYTES
    fits = header(meta=b"", payload_bytes=RECORD_ALIGN_BYTES - BLOCK_BYTES)
    assert fits.record_bytes == RECORD_ALIGN_BYTES
    assert header(payload_bytes=0).record_bytes == RECORD_ALIGN_BYTES
    assert align_up(0, 4096) == 0 and align_up(1, 4096) == 4096 and align_up(4096, 4096) == 4096


def test_too_short_or_no_magic() -> None:
    data = header().encode()
    with pytest.raises(HeaderError, match="no record header"):
        decode(b"")
    with pytest.raises(HeaderError, match="no record header"):
        decode(data[:63])
    with pytest.raises(HeaderError, match="no record header"):
        decode(bytes(BLOCK_BYTES))  # zeros: unwritten space
    with pytest.raises(HeaderError, match="no record header"):
        decode(b"KVDL2REX" + data[8:])
    big = header(meta=bytes(4096)).encode()
    with pytest.raises(HeaderError, match="no record header"):
        decode(big[:BLOCK_BYTES])  # an 8 KiB header cut at 4 KiB
    assert header_bytes_at(big[:BLOCK_BYTES]) == HEADER_BYTES_MAX
    assert header_bytes_at(memoryview(data)) == BLOCK_BYTES


@pytest.mark.parametrize("announced", [0, 512, 4095, 4097, 12288, 1 << 31])
def test_unknown_header_size(announced: int) -> None:
    data = bytearray(header().encode())
    struct.pack_into("<I", data, 12, announced)
    assert header_bytes_at(bytes(data)) == 0
    with pytest.raises(HeaderError, match="no record header"):
        decode(bytes(data))


def test_version() -> None:
    data = bytearray(header().encode())
    struct.pack_into("<H", data, 8, 2)
    with pytest.raises(HeaderError, match="format version 2"):
        decode(reseal(data))


@pytest.mark.parametrize("position", [10, 20, 40, 64, 100, BLOCK_BYTES - 9, BLOCK_BYTES - 1])
def test_checksum_catches_any_flipped_byte(position: int) -> None:
    data = bytearray(header().encode())
    data[position] ^= 0x40
    with pytest.raises(HeaderError, match="header checksum mismatch"):
        decode(bytes(data))


def test_fields_overflow() -> None:
    data = bytearray(header().encode())
    struct.pack_into("<H", data, 60, BLOCK_BYTES)  # meta length past the header
    with pytest.raises(HeaderError, match="overflow"):
        decode(reseal(data))


@pytest.mark.parametrize(("offset", "fmt", "value"), [(32, "<Q", 3 * 65536), (40, "<Q", 1)])
def test_lengths_disagree(offset: int, fmt: str, value: int) -> None:
    # record bytes (32) or payload bytes (40) edited: the record length no
    # longer follows from the fields.
    data = bytearray(header(payload_bytes=1 << 20).encode())
    struct.pack_into(fmt, data, offset, value)
    with pytest.raises(HeaderError, match="does not match"):
        decode(reseal(data))


def test_header_size_disagrees_with_fields() -> None:
    small = header(meta=b"")
    data = bytearray(small.encode() + bytes(BLOCK_BYTES))
    struct.pack_into("<I", data, 12, HEADER_BYTES_MAX)  # says 8 KiB, fields fit 4 KiB
    struct.pack_into("<Q", data, BLOCK_BYTES - 8, 0)
    with pytest.raises(HeaderError, match="does not match"):
        decode(reseal(data))


def test_oversized_header_is_refused_on_encode() -> None:
    with pytest.raises(AssertionError):
        header(meta=bytes(HEADER_BYTES_MAX)).encode()
