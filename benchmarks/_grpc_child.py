"""Raw gRPC byte-streaming server for :func:`benchmarks.baselines.raw_grpc_streaming`.

Executed as a script (``python benchmarks/_grpc_child.py PARENT_PID``) so it runs in its own
process with the glibc ``MALLOC_*`` tunables the parent put in its environment. It uses no
protobuf schema at all: a ``grpc.method_handlers_generic_handler`` with identity (bytes)
serializers exposes

``/asyncps.bench.RawBytes/Download`` (unary -> stream)
    request ``struct "<QQ" (total_bytes, chunk_bytes)``; streams ``total_bytes`` bytes in
    ``chunk_bytes`` messages (the last one may be shorter).
``/asyncps.bench.RawBytes/Upload`` (stream -> unary)
    consumes byte messages; replies ``struct "<Q" (bytes received)``.

The server binds ``127.0.0.1:0``, prints ``PORT <n>`` on stdout and serves until its parent
process goes away (checked once a second), so it cannot outlive a killed benchmark.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc

SERVICE = "asyncps.bench.RawBytes"
DOWNLOAD = f"/{SERVICE}/Download"
UPLOAD = f"/{SERVICE}/Upload"
#: Message-size limit for both directions on server and client; far above any chunk.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

_chunk_cache: dict[int, bytes] = {}


def chunk_of(size: int) -> bytes:
    """Return a cached random ``bytes`` of ``size``, so streaming never re-allocates it."""
    chunk = _chunk_cache.get(size)
    if chunk is None:
        chunk = _chunk_cache[size] = os.urandom(size)
    return chunk


def iter_chunks(total_bytes: int, chunk_bytes: int) -> Iterator[bytes]:
    """Yield ``total_bytes`` bytes as ``chunk_bytes``-sized messages (the last may be short)."""
    chunk = chunk_of(chunk_bytes)
    full, rest = divmod(total_bytes, chunk_bytes)
    for _ in range(full):
        yield chunk
    if rest:
        yield chunk[:rest]


def _download(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    total_bytes, chunk_bytes = struct.unpack("<QQ", request)
    yield from iter_chunks(total_bytes, chunk_bytes)


def _upload(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    received = 0
    for message in request_iterator:
        received += len(message)
    return struct.pack("<Q", received)


def serve(parent_pid: int) -> None:
    """Serve Download/Upload on an ephemeral 127.0.0.1 port until ``parent_pid`` exits."""
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            # request_deserializer/response_serializer left as None = raw bytes.
            "Download": grpc.unary_stream_rpc_method_handler(_download),
            "Upload": grpc.stream_unary_rpc_method_handler(_upload),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"PORT {port}", flush=True)
    try:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
    finally:
        server.stop(grace=None)


def main(argv: Sequence[str]) -> int:
    """Entry point: ``_grpc_child.py PARENT_PID``."""
    serve(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
