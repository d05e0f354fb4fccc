"""Rebuilding a gRPC method handler around a new behaviour, for server interceptors.

A server interceptor sees only the method name and metadata; whatever needs the call's context
(the peer, its certificate) or its message streams has to run inside the handler, so the
interceptors of this project wrap the handler's behaviour and keep its kind and (de)serializers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]
else:  # the runtime class is not generic
    Handler = grpc.RpcMethodHandler

Behavior = Callable[[Any, grpc.ServicerContext], Any]

_MAKERS: dict[tuple[bool, bool], Callable[..., Handler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def kind(handler: Handler) -> tuple[bool, bool]:
    """(request streaming, response streaming) of a handler."""
    return bool(handler.request_streaming), bool(handler.response_streaming)


def behavior(handler: Handler) -> Behavior:
    """The function a handler calls with (request or request iterator, context)."""
    fn = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
          (True, False): handler.stream_unary, (True, True): handler.stream_stream}[kind(handler)]
    assert fn is not None
    return fn  # type: ignore[no-any-return]


def with_behavior(handler: Handler, new_behavior: Behavior, deserialize: bool = True) -> Handler:
    """A handler of the same kind and serializers as handler that calls new_behavior instead.

    deserialize=False drops the request deserializer: the request is then never parsed (for
    handlers that refuse a call without looking at it).
    """
    return _MAKERS[kind(handler)](
        new_behavior, request_deserializer=handler.request_deserializer if deserialize else None,
        response_serializer=handler.response_serializer)


def refusing(handler: Handler, code: grpc.StatusCode, message: str) -> Handler:
    """A handler of handler's kind that fails every call with code and message, unparsed."""

    def refuse(request_or_iterator: Any, context: grpc.ServicerContext) -> NoReturn:
        context.abort(code, message)
        raise AssertionError("unreachable: abort raises")

    return with_behavior(handler, refuse, deserialize=False)
