"""The KVStore service on both ends of gRPC, built from its descriptor in
``kvd_pb2`` (protoc generates only the messages; its ``--grpc_python_out``
stubs, one hand-unrolled block per method, are not used).

Server: ``add_kvstore``. protoc's ``add_KVStoreServicer_to_server`` parses
requests before any kvd code runs, and grpcio answers bytes that do not parse
with UNKNOWN ("Unexpected DecodeError"). Here every method takes raw bytes and
parses them itself, so such a request gets INVALID_ARGUMENT, as the contract
says for bad input. Responses are serialized as usual.

Client: ``KVStoreStub(channel)``, one callable per method named as in the
.proto, on a blocking or an asyncio channel alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from kvd.v1 import kvd_pb2

SERVICE = "kvd.v1.KVStore"
# The version of the calls pool members make to each other, over gRPC and
# their bulk ports (DescribePathsResponse.pool_version): a member calls no
# peer that says another. A daemon that says none (0) speaks version 1.
POOL_VERSION = 1


def _bad_request(name: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {name}: {exc}"


def _unary(fn: Callable[..., Any], request_type: type[Message]) -> Callable[..., Any]:
    async def handler(raw: bytes, context: Any) -> Any:
        try:
            request = request_type.FromString(raw)
        except DecodeError as exc:
            await context.abort(*_bad_request(request_type.__name__, exc))
        return await fn(request, context)

    return handler


def _server_stream(fn: Callable[..., Any], request_type: type[Message]) -> Callable[..., Any]:
    async def handler(raw: bytes, context: Any) -> AsyncIterator[Any]:
        try:
            request = request_type.FromString(raw)
        except DecodeError as exc:
            await context.abort(*_bad_request(request_type.__name__, exc))
        async for response in fn(request, context):
            yield response

    return handler


def _client_stream(fn: Callable[..., Any], request_type: type[Message]) -> Callable[..., Any]:
    async def handler(raws: AsyncIterator[bytes], context: Any) -> Any:
        async def parsed() -> AsyncIterator[Message]:
            async for raw in raws:
                try:
                    yield request_type.FromString(raw)
                except DecodeError as exc:
                    await context.abort(*_bad_request(request_type.__name__, exc))

        return await fn(parsed(), context)

    return handler


def add_kvstore(servicer: Any, server: Any) -> None:
    """Serve every KVStore method of ``servicer`` on ``server``."""
    service = kvd_pb2.DESCRIPTOR.services_by_name["KVStore"]
    handlers = {}
    for method in service.methods:
        request_type = getattr(kvd_pb2, method.input_type.name)
        response_type = getattr(kvd_pb2, method.output_type.name)
        fn = getattr(servicer, method.name)
        serialize = response_type.SerializeToString
        if method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(
                _client_stream(fn, request_type), response_serializer=serialize
            )
        elif method.server_streaming and not method.client_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _server_stream(fn, request_type), response_serializer=serialize
            )
        else:
            assert not method.client_streaming, f"{method.name}: bidirectional is not used"
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(fn, request_type), response_serializer=serialize
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


class KVStoreStub:
    """What protoc's generated stub offers: ``stub.Put``, ``stub.Get``, ..."""

    def __init__(self, channel: Any) -> None:
        for method in kvd_pb2.DESCRIPTOR.services_by_name["KVStore"].methods:
            streams = (method.client_streaming, method.server_streaming)
            make = {
                (False, False): channel.unary_unary,
                (False, True): channel.unary_stream,
                (True, False): channel.stream_unary,
                (True, True): channel.stream_stream,
            }[streams]
            call = make(
                f"/{SERVICE}/{method.name}",
                request_serializer=getattr(kvd_pb2, method.input_type.name).SerializeToString,
                response_deserializer=getattr(kvd_pb2, method.output_type.name).FromString,
            )
            setattr(self, method.name, call)

    def __getattr__(self, name: str) -> Any:  # the methods above, for the type checker
        raise AttributeError(f"KVStore has no method {name}")
