"""The Generate request before any real work: bytes that do not parse, and sizes checked cheaply.

gRPC parses a request before the handler runs, and a parse failure there (a string field that is
not valid UTF-8, a truncated message) would answer UNKNOWN and log a traceback at ERROR. The
Gateway's ``Generate`` is therefore registered with a deserializer that hands such bytes on as an
``UndecodableRequest``; the handler answers INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from specdec.v1 import gateway_pb2
from specdec.wire_types import FieldError

# How far ``bad_utf8_field`` looks (a request of many tiny fields must not cost seconds to explain).
MAX_FIELDS_SCANNED = 10_000


class UndecodableRequest:
    """Request bytes that do not parse as a ``GenerateRequest``."""

    def __init__(self, data: bytes, error: Exception) -> None:
        self.data = data
        self.error = error

    def explain(self) -> FieldError:
        """The INVALID_ARGUMENT error; walks the wire format (run it off the event loop)."""
        field = bad_utf8_field(self.data, gateway_pb2.GenerateRequest.DESCRIPTOR)
        if field is not None:
            return FieldError(field, "not valid UTF-8 (string fields must be UTF-8)")
        return FieldError("request", f"does not parse as a GenerateRequest ({self.error})")


def parse_generate_request(data: bytes):
    try:
        return gateway_pb2.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return UndecodableRequest(data, exc)


def add_gateway_service(servicer, server) -> None:
    """``gateway_pb2_grpc.add_GatewayServicer_to_server``, with ``parse_generate_request``."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=parse_generate_request,
            response_serializer=gateway_pb2.GenerateResponse.SerializeToString,
        ),
    }
    name = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]  # IndexError: truncated
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _repeated(field) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 6 (``label`` is gone in 7)
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


def bad_utf8_field(data: bytes, descriptor, prefix: str = "", budget: list[int] | None = None) -> str | None:
    """The path (``messages[2].content``) of the first string field in ``data`` that is not valid
    UTF-8, or None (none found, or the bytes are malformed in another way)."""
    budget = budget if budget is not None else [MAX_FIELDS_SCANNED]
    seen: dict[int, int] = {}
    pos, end = 0, len(data)
    try:
        while pos < end:
            budget[0] -= 1
            if budget[0] < 0:
                return None
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + length], pos + length
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                name = prefix + field.name
                if _repeated(field):
                    index = seen.get(number, 0)
                    seen[number] = index + 1
                    name = f"{name}[{index}]"
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = bad_utf8_field(chunk, field.message_type, name + ".", budget)
                    if found is not None:
                        return found
            else:
                return None
    except (IndexError, ValueError):
        return None
    return None
