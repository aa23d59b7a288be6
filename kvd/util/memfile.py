"""Bytes handed to an API that takes only a path (OpenSSL's certificate
chain and key loading), through an in-memory file: never written to disk."""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import Iterator


@contextlib.contextmanager
def memory_file(data: bytes) -> Iterator[str]:
    """A path to ``data`` that exists in memory only, while the block runs (``memfd``)."""
    fd = os.memfd_create("kvd-bytes", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def load_chain(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """``context.load_cert_chain`` of these bytes."""
    with memory_file(cert) as cert_path, memory_file(key) as key_path:
        context.load_cert_chain(cert_path, key_path)
