"""gRPC server reflection under both names: ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

grpcurl, Postman and current gRPC tools ask ``grpc.reflection.v1.ServerReflection`` first;
grpcio-reflection (1.85) ships only the v1alpha servicer, so ``grpcurl describe
blockd.v1.BlockdService.Stats`` failed. The two protocols are the same messages in two
packages (byte for byte on the wire), so one servicer answers both: its v1alpha handler is
also registered under the v1 name, and a copy of the reflection proto under the v1 package is
added to the descriptor pool, so the v1 service itself can be described too. A method's name
(``blockd.v1.BlockdService.Stats``, what ``grpcurl describe`` asks for) is answered with its
service's file, as the C++ and Go servers answer it; grpcio-reflection's servicer knew only
top-level symbols.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as alpha

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
SERVICE_NAMES = (V1_SERVICE, reflection.SERVICE_NAME)


def _add_v1_file(pool: descriptor_pool.DescriptorPool) -> None:
    """The v1alpha file under the v1 package and file name, once."""
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    alpha.DESCRIPTOR.CopyToProto(proto)
    old = proto.package
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(f".{old}.", f".{V1_PACKAGE}.")
    for message in proto.message_type:
        for f in message.field:
            if f.type_name.startswith(f".{old}."):
                f.type_name = f.type_name.replace(f".{old}.", f".{V1_PACKAGE}.")
    proto.options.Clear()
    pool.Add(proto)


class _Reflection:
    """grpcio-reflection's asyncio servicer, asked for a method's service where it is asked
    for a method (which it does not resolve); each answer names the request as sent."""

    def __init__(self, names: Iterable[str], pool: descriptor_pool.DescriptorPool) -> None:
        #: Typed Any: its stubs declare ServerReflectionInfo a coroutine, not an async generator.
        self.inner: Any = reflection.aio.ReflectionServicer(tuple(names), pool=pool)
        self.pool = pool

    def _service_of_method(self, symbol: str) -> str:
        """``symbol``'s service when it names a method the pool has no file for, else ""."""
        try:
            self.pool.FindFileContainingSymbol(symbol)
            return ""
        except KeyError:
            pass
        service, _, method = symbol.rpartition(".")
        try:
            found = self.pool.FindServiceByName(service)
        except KeyError:
            return ""
        return service if method in found.methods_by_name else ""

    async def ServerReflectionInfo(self, requests: AsyncIterator[Any], context: Any
                                   ) -> AsyncIterator[Any]:
        sent: deque[Any] = deque()

        async def asked() -> AsyncIterator[Any]:
            async for request in requests:
                sent.append(request)
                service = (self._service_of_method(request.file_containing_symbol)
                           if request.HasField("file_containing_symbol") else "")
                if service:
                    request = alpha.ServerReflectionRequest(
                        host=request.host, file_containing_symbol=service)
                yield request

        async for response in self.inner.ServerReflectionInfo(asked(), context):
            response.original_request.CopyFrom(sent.popleft())
            yield response


def enable(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Reflection of ``service_names`` and of itself, under v1 and v1alpha."""
    pool = descriptor_pool.Default()
    _add_v1_file(pool)
    servicer = _Reflection((*service_names, *SERVICE_NAMES), pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=alpha.ServerReflectionRequest.FromString,
        response_serializer=alpha.ServerReflectionResponse.SerializeToString)
    for name in SERVICE_NAMES:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            name, {"ServerReflectionInfo": handler}),))
