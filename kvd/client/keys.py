"""Chained block keys, computed the same way in every process.

``h_i = SHA-256(h_{i-1} || len(extra) || extra || tokens_i)`` with tokens
as little-endian int64 and ``h_{-1}`` the optional parent (32 zero bytes
when there is none). A key therefore names its whole prefix, as vLLM's and
SGLang's block hashes do, and never depends on Python's ``hash()`` or
``PYTHONHASHSEED``.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

KEY_DIGEST_BYTES = 32
_ROOT = bytes(KEY_DIGEST_BYTES)


def chain_keys(
    tokens: Sequence[int],
    chunk_tokens: int,
    extra: bytes = b"",
    parent: bytes | None = None,
    *,
    include_partial: bool = False,
) -> list[bytes]:
    """One 32-byte key per full chunk of ``chunk_tokens`` tokens (and the tail if asked)."""
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    prefix = parent if parent is not None else _ROOT
    salt = struct.pack("<I", len(extra)) + extra
    keys: list[bytes] = []
    end = len(tokens) if include_partial else len(tokens) - len(tokens) % chunk_tokens
    for start in range(0, end, chunk_tokens):
        chunk = array("q", tokens[start : min(start + chunk_tokens, end)])
        if chunk.itemsize != 8:  # pragma: no cover - 'q' is 8 bytes on every CPython
            raise AssertionError("int64 array is not 8 bytes")
        digest = hashlib.sha256(prefix)
        digest.update(salt)
        digest.update(
            chunk.tobytes() if struct.pack("=q", 1) == struct.pack("<q", 1) else _le(chunk)
        )
        prefix = digest.digest()
        keys.append(prefix)
    return keys


def _le(chunk: array[int]) -> bytes:  # pragma: no cover - big-endian hosts only
    swapped = array("q", chunk)
    swapped.byteswap()
    return swapped.tobytes()
