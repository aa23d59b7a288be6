"""A chain's keys on the shm socket and in a PEER_EXISTS: cut and joined."""

from __future__ import annotations

import pytest

from kvd.wire.shm import join_keys, split_keys


@pytest.mark.parametrize("count", [0, 1, 7, 1000])
def test_split_keys_undoes_join_keys(count: int) -> None:
    keys = [b"k%07d" % i for i in range(count)]
    joined = join_keys(keys)
    if not keys:
        assert joined is None  # no chain: gRPC answers it
        assert split_keys(b"", 8) == []
        return
    assert joined is not None
    width, data = joined
    assert split_keys(data, width) == keys
    assert split_keys(memoryview(data), width) == keys  # a frame's buffer, not bytes
    assert all(type(key) is bytes for key in split_keys(memoryview(data), width))


def test_split_keys_of_many_widths_and_counts() -> None:
    """More chain shapes than formats kept: each still cut right."""
    for width in (1, 16, 255):
        for count in range(1, 20):
            keys = [bytes([i % 251]) * width for i in range(count)]
            assert split_keys(b"".join(keys), width) == keys


@pytest.mark.parametrize(("size", "width"), [(10, 3), (5, 0), (5, -1)])
def test_split_keys_refuses_partial_keys(size: int, width: int) -> None:
    with pytest.raises(ValueError, match="not whole keys"):
        split_keys(b"x" * size, width)
