"""asyncps.wire.stream's receive, of small and large buffers: everything in order, and a peer that
stalls or closes midway ends it with TimeoutError (by the deadline) or StreamClosed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from asyncps.wire.stream import StreamClosed, recv_exactly


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("nbytes", [1000, 3 << 20])
def test_the_whole_buffer_arrives_in_order(pair: tuple[socket.socket, socket.socket], nbytes: int) -> None:
    a, b = pair
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    sender = threading.Thread(target=a.sendall, args=(memoryview(data),))
    sender.start()
    out = np.empty(nbytes, np.uint8)
    b.settimeout(5.0)
    recv_exactly(b, memoryview(out), time.monotonic() + 10)
    sender.join()
    assert np.array_equal(out, data)
    assert b.gettimeout() is not None  # the socket keeps its timeout mode


@pytest.mark.parametrize("nbytes", [1000, 3 << 20])
def test_a_peer_that_stalls_midway_meets_the_deadline(pair: tuple[socket.socket, socket.socket], nbytes: int) -> None:
    a, b = pair
    b.settimeout(30.0)
    sender = threading.Thread(target=a.sendall, args=(bytes(nbytes // 2),), daemon=True)
    sender.start()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        recv_exactly(b, memoryview(bytearray(nbytes)), started + 0.5)
    assert 0.4 < time.monotonic() - started < 3.0
    assert b.gettimeout() is not None  # never left blocking: later sends keep their timeouts


@pytest.mark.parametrize("nbytes", [1000, 3 << 20])
def test_a_peer_that_closes_midway_is_stream_closed(pair: tuple[socket.socket, socket.socket], nbytes: int) -> None:
    a, b = pair

    def send_half_and_close() -> None:
        a.sendall(bytes(nbytes // 2))
        a.shutdown(socket.SHUT_WR)

    threading.Thread(target=send_half_and_close, daemon=True).start()
    with pytest.raises(StreamClosed, match=f"after {nbytes // 2} of {nbytes} bytes"):
        recv_exactly(b, memoryview(bytearray(nbytes)), time.monotonic() + 10)
