"""Raw TCP byte server for :func:`benchmarks.baselines.raw_tcp`: the floor a TCP data path can reach.

Executed as a script (``python benchmarks/_tcp_child.py PARENT_PID``) in its own process. It binds
``127.0.0.1:0``, prints ``PORT <n>`` and serves one connection at a time, each a sequence of
requests ``struct "<BQ" (kind, total_bytes)``:

kind 0, download
    the server sends ``total_bytes`` bytes from one preallocated buffer (``sendall`` of a
    memoryview: no per-message object, no copy).
kind 1, upload
    the client sends ``total_bytes`` bytes, received with ``recv_into`` a preallocated buffer;
    the server replies ``struct "<Q" (bytes received)``.

So a pull or push of the same bytes over asyncps's tcp path can be put beside the cost of the
socket alone. It exits when its parent goes away (checked once a second).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence

REQUEST = struct.Struct("<BQ")
DOWNLOAD, UPLOAD = 0, 1
MAX_BYTES = 1 << 31


def recv_exactly(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from `sock`; the bytes received (fewer only when the peer closed)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def _serve_connection(sock: socket.socket, buffer: memoryview) -> None:
    head = memoryview(bytearray(REQUEST.size))
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while recv_exactly(sock, head) == REQUEST.size:
            kind, total = REQUEST.unpack(head)
            if total > len(buffer):
                return
            if kind == DOWNLOAD:
                sock.sendall(buffer[:total])
            elif kind == UPLOAD:
                sock.sendall(struct.pack("<Q", recv_exactly(sock, buffer[:total])))
            else:
                return


def serve(parent_pid: int) -> None:
    """Serve on an ephemeral 127.0.0.1 port until ``parent_pid`` exits."""
    listener = socket.create_server(("127.0.0.1", 0))
    buffer = memoryview(bytearray(os.urandom(1 << 20) * 64))  # 64 MiB, filled once
    print(f"PORT {listener.getsockname()[1]}", flush=True)

    def accept() -> None:
        while True:
            sock, _ = listener.accept()
            _serve_connection(sock, buffer)

    threading.Thread(target=accept, daemon=True).start()
    while os.getppid() == parent_pid:
        time.sleep(1.0)


def main(argv: Sequence[str]) -> int:
    """Entry point: ``_tcp_child.py PARENT_PID``."""
    serve(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
