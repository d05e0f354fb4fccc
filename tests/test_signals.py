"""asyncps.signals: a signal's action runs in the dispatch thread, never inside the handler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from asyncps.signals import SignalRoute

ROOT = Path(__file__).resolve().parent.parent


def test_the_action_runs_in_the_dispatch_thread_and_restore_gives_the_signal_back() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    ran = threading.Event()
    where: list[str] = []

    def action(signum: int) -> None:
        where.append(threading.current_thread().name)
        ran.set()

    route = SignalRoute({signal.SIGUSR1: action}).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ran.wait(10), "the action never ran"
        assert where == ["signals"] and signal.getsignal(signal.SIGUSR1) is not before
    finally:
        route.restore()
    assert signal.getsignal(signal.SIGUSR1) is before


# A process whose main thread waits on the very event its SIGTERM sets, in a loop of short waits (each one
# takes and releases the event's lock: where a handler calling event.set() could deadlock it).
WAITER = """
import signal, sys, threading
from asyncps.signals import SignalRoute
stop = threading.Event()
SignalRoute({signal.SIGTERM: lambda _: stop.set()}).install()
print("ready", flush=True)
while not stop.wait(0.0001):
    pass
print("stopped", flush=True)
"""


def test_sigterm_stops_a_main_thread_that_waits_on_the_event_it_sets() -> None:
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", WAITER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0 and out.strip() == "stopped"
