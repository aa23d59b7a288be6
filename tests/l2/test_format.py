"""Tests for kvd.l2.format: header round trips and every HeaderError path."""

from __future__ import annotations

import random
import struct

import pytest

from kvd.io.backend import ReadStatus, native_record_check, native_xxh3_64
from kvd.l2.format import (
    BLOCK_BYTES,
    FLAG_TOMBSTONE,
    HEADER_BYTES_MAX,
    MAGIC,
    RECORD_ALIGN_BYTES,
    HeaderError,
    RecordHeader,
    align_up,
    check_record,
    decode,
    header_bytes_at,
)
from kvd.wire.checksum import checksum


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


# ---- record checks: format.check_record and its C twin agree ------------------------
NATIVE_CHECK = native_record_check()
NATIVE_XXH3 = native_xxh3_64()
needs_native = pytest.mark.skipif(NATIVE_CHECK is None, reason="kvd.io._uring is not built")
PAYLOAD = random.Random(5).randbytes(70_000)
GOOD = header(payload_bytes=len(PAYLOAD), payload_checksum=checksum(PAYLOAD))


def expect(**changes: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "payload_bytes": GOOD.payload_bytes, "payload_checksum": GOOD.payload_checksum,
        "seq": GOOD.seq, "generation": GOOD.generation,
        "namespace": GOOD.namespace.encode(), "key": GOOD.key,
    }  # fmt: skip
    fields.update(changes)
    return fields


def verdicts(head: bytes, payload: list[bytes], **expected: object) -> tuple[int, int]:
    """(Python's verdict, C's verdict) on the same bytes and expectations."""
    e = expect(**expected)
    args = (e["payload_bytes"], e["payload_checksum"], e["seq"], e["generation"],
            e["namespace"], e["key"])  # fmt: skip
    views = [memoryview(p) for p in payload]
    python = check_record(memoryview(head), views, *args)  # type: ignore[arg-type]
    assert NATIVE_CHECK is not None
    return int(python), NATIVE_CHECK(head, payload, *args)


def mutate(at: int, value: bytes, *, resign: bool = True) -> bytes:
    """GOOD's header with ``value`` at ``at``; re-signed so later checks are reached."""
    data = bytearray(GOOD.encode())
    data[at : at + len(value)] = value
    if resign:
        data[-8:] = struct.pack("<Q", checksum(bytes(data[:-8])))
    return bytes(data)


@needs_native
def test_xxh3_of_the_native_checks_is_the_python_packages() -> None:
    assert NATIVE_XXH3 is not None
    rng = random.Random(11)
    # Sizes around xxh3's internal boundaries (16, 128, 240 bytes, stripes, blocks).
    for size in (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025, 65536, 1 << 20):
        data = rng.randbytes(size)
        assert NATIVE_XXH3(data) == checksum(data), size


@needs_native
def test_a_good_record_passes_both() -> None:
    head = GOOD.encode()
    assert verdicts(head, [PAYLOAD]) == (ReadStatus.OK, ReadStatus.OK)
    pieces = [PAYLOAD[:1], PAYLOAD[1:4096], PAYLOAD[4096:50_001], PAYLOAD[50_001:]]
    assert verdicts(head, pieces) == (ReadStatus.OK, ReadStatus.OK)
    # The payload views run past the payload (whole 4 KiB blocks): the tail is not in it.
    assert verdicts(head, [PAYLOAD + b"\xff" * 1000]) == (ReadStatus.OK, ReadStatus.OK)
    empty = header(payload_bytes=0, payload_checksum=checksum(b""))
    assert verdicts(empty.encode(), [], payload_bytes=0, payload_checksum=checksum(b"")) == (
        ReadStatus.OK, ReadStatus.OK,
    )  # fmt: skip


FIELD_DAMAGE = {
    "magic": (0, b"X"),
    "version": (8, struct.pack("<H", 2)),
    "tombstone": (10, struct.pack("<H", FLAG_TOMBSTONE)),
    "segment marker": (10, struct.pack("<H", 2)),
    "header bytes": (12, struct.pack("<I", HEADER_BYTES_MAX)),
    "generation": (16, b"\x00"),
    "seq": (24, b"\x00"),
    "record bytes": (32, struct.pack("<Q", 0)),
    "payload bytes": (40, struct.pack("<Q", len(PAYLOAD) - 1)),
    "payload checksum": (48, b"\x00"),
    "namespace length": (56, struct.pack("<H", 5)),
    "key length": (58, b"\x05"),
    "meta length": (60, struct.pack("<H", 4000)),
    "namespace byte": (64, b"M"),
    "key byte": (64 + len(GOOD.namespace) + 3, b"\xee"),
}


@needs_native
@pytest.mark.parametrize("resign", [True, False], ids=["resigned", "torn"])
@pytest.mark.parametrize("field", list(FIELD_DAMAGE))
def test_each_damaged_field_is_a_bad_header_to_both(field: str, resign: bool) -> None:
    at, value = FIELD_DAMAGE[field]
    head = mutate(at, value, resign=resign)
    assert verdicts(head, [PAYLOAD]) == (ReadStatus.BAD_HEADER, ReadStatus.BAD_HEADER)


@needs_native
@pytest.mark.parametrize(
    "wrong",
    [{"seq": GOOD.seq + 1}, {"generation": GOOD.generation ^ 1}, {"key": GOOD.key[:-1]},
     {"key": GOOD.key[:-1] + b"\x00"}, {"namespace": b"model=llama;tp=1/2"},
     {"payload_bytes": len(PAYLOAD) + 1}, {"payload_checksum": GOOD.payload_checksum ^ 1}],
)  # fmt: skip
def test_a_record_that_is_not_the_expected_one_is_a_bad_header(wrong: dict[str, object]) -> None:
    assert verdicts(GOOD.encode(), [PAYLOAD], **wrong) == (
        ReadStatus.BAD_HEADER, ReadStatus.BAD_HEADER,
    )  # fmt: skip


@needs_native
def test_payload_damage_and_short_payload() -> None:
    head = GOOD.encode()
    for at in (0, 4095, 4096, len(PAYLOAD) - 1):
        flipped = bytearray(PAYLOAD)
        flipped[at] ^= 0x10
        assert verdicts(head, [bytes(flipped)]) == (ReadStatus.BAD_CHECKSUM,) * 2
    assert verdicts(head, [PAYLOAD[:-1]]) == (ReadStatus.SHORT, ReadStatus.SHORT)
    # A header buffer that is not a whole header is never one.
    assert verdicts(head[:100], [PAYLOAD]) == (ReadStatus.BAD_HEADER,) * 2


@needs_native
def test_random_damage_gets_the_same_verdict_from_both() -> None:
    rng = random.Random(2024)
    good = GOOD.encode()
    seen = set()
    for _ in range(2000):
        at = rng.randrange(64 + 96) if rng.random() < 0.8 else rng.randrange(len(good))
        value = bytes([rng.randrange(256)])
        head = mutate(at, value, resign=rng.random() < 0.7)
        python, native = verdicts(head, [PAYLOAD])
        assert python == native, (at, value)
        seen.add(python)
    assert seen == {ReadStatus.OK, ReadStatus.BAD_HEADER}
