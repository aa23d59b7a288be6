"""A plain gRPC echo server: the ceiling for kvd's gRPC path.

It answers a size with that many bytes, already built, in a protobuf
``bytes`` field (kvd.v1.GetResponse's ``data``): once as one unary message
and once streamed in 1 MiB messages, as kvd's Get streams. kvd's Get has
the same framing plus the work of a store, so the ratio between the two is
what kvd itself costs.

Run as ``python -m kvd.tools.bench.echo``; it prints ``port=N`` once serving.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvd.v1 import kvd_pb2 as pb

SERVICE = "kvd.tools.bench.Echo"
CHUNK_BYTES = 1 << 20
MESSAGE_BYTES_MAX = (64 << 20) + (1 << 20)


def encode_size(nbytes: int) -> bytes:
    return struct.pack("<Q", nbytes)


class _Echo:
    def __init__(self) -> None:
        self._blobs: dict[int, bytes] = {}

    def _blob(self, nbytes: int) -> bytes:
        if nbytes not in self._blobs:
            self._blobs[nbytes] = bytes(nbytes)
        return self._blobs[nbytes]

    async def unary(self, request: bytes, context: Any) -> pb.GetResponse:
        (nbytes,) = struct.unpack("<Q", request)
        return pb.GetResponse(data=self._blob(nbytes))

    async def stream(self, request: bytes, context: Any) -> AsyncIterator[pb.GetResponse]:
        (nbytes,) = struct.unpack("<Q", request)
        blob = memoryview(self._blob(nbytes))
        for offset in range(0, nbytes, CHUNK_BYTES):
            yield pb.GetResponse(data=bytes(blob[offset : offset + CHUNK_BYTES]))


async def _serve() -> None:
    echo = _Echo()
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MESSAGE_BYTES_MAX),
            ("grpc.max_receive_message_length", MESSAGE_BYTES_MAX),
        ]
    )
    serialize = pb.GetResponse.SerializeToString
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(echo.unary, response_serializer=serialize),
        "Stream": grpc.unary_stream_rpc_method_handler(echo.stream, response_serializer=serialize),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"port={port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    try:
        import uvloop

        uvloop.run(_serve())
    except ImportError:  # pragma: no cover
        asyncio.run(_serve())


if __name__ == "__main__":
    main()
