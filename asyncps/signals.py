"""Signals handled in a thread of their own, never inside the signal handler.

Python runs a signal handler in the main thread between two bytecodes: possibly in the middle of
`threading.Event.wait()`, holding the event's (non-reentrant) lock, where a handler that calls
`event.set()` takes that lock again and the process hangs for good (a shard that "ignored SIGTERM").
Here the C-level handler only writes the signal's number to a socket (`signal.set_wakeup_fd`); a
daemon thread reads it and runs the action, taking whatever locks it needs like any other thread.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

Action = Callable[[int], None]


def _ignore(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: nothing (the wakeup fd carries the signal to the dispatch thread)."""


class SignalRoute:
    """Route signals to actions run by a dispatch thread; `install()` and `restore()` from the main thread."""

    def __init__(self, actions: Mapping[int, Action]) -> None:
        self._actions = dict(actions)
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._old_handlers: dict[int, Any] = {}
        self._old_fd = -1
        self._thread = threading.Thread(target=self._dispatch, name="signals", daemon=True)

    def install(self) -> SignalRoute:
        """Take over the signals (the previous handlers and wakeup fd are kept for restore)."""
        self._thread.start()
        self._old_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        for signum in self._actions:
            self._old_handlers[signum] = signal.signal(signum, _ignore)
        return self

    def restore(self) -> None:
        """Give the signals back to their previous handlers and stop the dispatch thread."""
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._old_fd)
        self._writer.close()  # the dispatch thread reads end-of-file and returns
        self._thread.join(timeout=5.0)
        self._reader.close()

    def _dispatch(self) -> None:
        while True:
            try:
                received = self._reader.recv(64)
            except OSError:
                return
            if not received:
                return
            for signum in received:
                action = self._actions.get(signum)
                if action is not None:
                    action(signum)


__all__ = ["Action", "SignalRoute"]
