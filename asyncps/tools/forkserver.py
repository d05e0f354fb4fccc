"""A fork server for a local cluster: TensorFlow loaded once, every chief and worker process forked from it.

Each chief and worker process imports TensorFlow and Keras before it does anything else: ~2.5 CPU-s here, most of
what a short run costs. A local cluster of a chief and two worker processes paid it three times, and a test suite or
an experiment sweep that starts hundreds of clusters spent most of its CPU there. So the launcher starts one server
per cluster, beside the shards: it imports TensorFlow, Keras and the roles' modules once, then forks one process per
chief or worker the launcher asks for. Importing starts none of TensorFlow's runtime (no op has run, no thread pool
exists), so a child forked then is as clean as a new one: it takes its own session, log, environment and thread
limits, and runs the CLI entry point an exec'd child runs (`asyncps.procenv.cli_command`). The shards are exec'd as
before: they need no TensorFlow, and their image has none.

The launcher holds a `ForkedProcess` per child, with the part of `subprocess.Popen`'s interface a launcher uses
(pid, poll, wait, send_signal, terminate, kill, returncode). Only the server can reap its children, so it reports
each exit on its pipe. If the server itself dies, the launcher starts later processes by exec and reads a lost
child's end from /proc (its status is then unknown: `LOST_STATUS`).

Protocol, one JSON object per line: launcher -> server on the server's stdin `{"args": [...], "env": {...},
"log": PATH}`; server -> launcher on its stdout `{"pid": N}` or `{"error": TEXT}` in answer, and `{"exit": N,
"code": C}` when child N ends (C as Popen's returncode: the exit status, or minus the signal).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, Protocol

#: What the server imports before its first fork: TensorFlow, Keras and the roles' modules.
PRELOAD: tuple[str, ...] = ("tensorflow", "keras", "asyncps.ml.models", "asyncps.tools.cli", "asyncps.chief.main",
                            "asyncps.worker.main")

#: Where the launcher forks: Linux. macOS forbids much of its system frameworks in a child forked from a process
#: that loaded them (TensorFlow's import does), and Windows has no fork: there every process is exec'd.
FORK_SUPPORTED = sys.platform.startswith("linux")

#: The returncode of a child whose server died before it could report the child's end.
LOST_STATUS = -int(signal.SIGKILL)

#: How the launcher starts the server (as `procenv.cli_command`: the working directory off the path).
SERVER_BOOTSTRAP = "import sys; del sys.path[0]; from asyncps.tools.forkmain import main; sys.exit(main())"

POLL_S = 0.1  # how often a wait looks at /proc when the server cannot report
SPAWN_TIMEOUT_S = 300.0  # the server answers once its imports are done: a slow machine under load takes a while


class Process(Protocol):
    """What a launcher uses of a child process: `subprocess.Popen` and `ForkedProcess` both have it."""

    @property
    def pid(self) -> int:
        """The process id."""

    @property
    def returncode(self) -> int | Any:
        """The exit code once known, else None."""

    def poll(self) -> int | None:
        """The exit code once the process has ended, else None."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; subprocess.TimeoutExpired after `timeout` seconds."""

    def send_signal(self, sig: int) -> None:
        """Signal the process, unless it has ended."""

    def terminate(self) -> None:
        """SIGTERM."""

    def kill(self) -> None:
        """SIGKILL."""


class ForkedProcess:
    """A child of the fork server, seen from the launcher."""

    def __init__(self, pid: int, args: list[str], server: ForkServer) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._server = server

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        """The exit code once the process has ended, else None."""
        if self.returncode is None and not self._server.reporting and not _exists(self.pid):
            self._end(LOST_STATUS)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; subprocess.TimeoutExpired after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._ended.wait(POLL_S if left is None else min(POLL_S, left))  # the event, or a look at /proc
        return code

    def send_signal(self, sig: int) -> None:
        """Signal the process, unless it has ended (as Popen does)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


def _exists(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class ForkServer:
    """The launcher's side: starts the server, asks it for children, and tracks their ends."""

    def __init__(self, env: dict[str, str], log_path: Path | None = None) -> None:
        """A server started with `env`; its own output (TensorFlow's start-up lines) to `log_path`, else nowhere: a
        server that cannot start makes the launcher exec the child, whose log then says what failed."""
        self._log: IO[bytes] = open(log_path or os.devnull, "ab")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", SERVER_BOOTSTRAP, "fork-server", f"of-{os.getpid()}"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, env=env, start_new_session=True)
        self._lock = threading.Lock()  # one request in flight
        self._answer: list[dict[str, Any]] = []
        self._answered = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._pending_args: list[str] = []
        self.reporting = True  # the server is alive and reports every exit
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self._answered:
                if "exit" in message:
                    child = self._children.pop(int(message["exit"]), None)
                    if child is not None:
                        child._end(int(message["code"]))
                    continue
                if "pid" in message:  # registered here, before any exit of it can be read; the answer holds it
                    child = ForkedProcess(int(message["pid"]), self._pending_args, self)  # even if that exit comes
                    self._children[child.pid] = message["process"] = child  # before the asker wakes
                self._answer.append(message)
                self._answered.notify_all()
        with self._answered:
            self.reporting = False
            self._answered.notify_all()

    @property
    def pid(self) -> int | None:
        """The server's pid while it serves, else None."""
        return self._proc.pid if self.reporting else None

    def spawn(self, args: list[str], env: dict[str, str], log_path: Path) -> ForkedProcess | None:
        """A child running `asyncps ARGS` with `env`, its output appended to `log_path`; None when the server
        cannot fork (it died, or said why on its log): the caller then execs the child itself."""
        request = json.dumps({"args": args, "env": env, "log": str(log_path), "cwd": os.getcwd()}).encode() + b"\n"
        with self._lock:
            if not self.reporting or self._proc.stdin is None:
                return None
            with self._answered:
                self._answer.clear()
                self._pending_args = args
            try:
                self._proc.stdin.write(request)
                self._proc.stdin.flush()
            except OSError:
                return None
            with self._answered:
                self._answered.wait_for(lambda: bool(self._answer) or not self.reporting, SPAWN_TIMEOUT_S)
                answer = self._answer.pop() if self._answer else {}
                process = answer.get("process")
                return process if isinstance(process, ForkedProcess) else None

    def close(self) -> None:
        """Stop the server (its children, if any live, carry on: the launcher stops them)."""
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=5)
        self._log.close()


_REPLIES = [-1]  # the server's reply fd: its stdout as started; fd 1 itself goes to its log, so no print reaches it


_SERVERS: dict[str, ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def shared_server(env: dict[str, str], per_request: Iterable[str] = ()) -> ForkServer:
    """The fork server of this process for `env`, started on first use and kept until the process exits: a sweep,
    a notebook or a test session pays for TensorFlow's import once, not once per cluster. Each request carries its
    child's whole environment, so only what a process reads as it starts (the allocator's tunables, a module's
    constant) needs the same server: servers are told apart by `env` without the `per_request` variables."""
    key = json.dumps(sorted((k, v) for k, v in env.items() if k not in set(per_request)))
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None or not server.reporting:
            server = _SERVERS[key] = ForkServer(env)
        return server


@atexit.register
def close_shared_servers() -> None:
    """Stop every shared server (each would stop by itself once this process is gone and its pipe closes)."""
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for server in servers:
        server.close()


def _send(message: dict[str, Any]) -> None:
    os.write(_REPLIES[0], json.dumps(message).encode() + b"\n")


def _reap() -> None:
    """Report every child that has ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(request: dict[str, Any]) -> list[str]:
    """In the forked child: its own session, log, stdin and environment; the CLI arguments to run."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request.get("cwd", "."))
    args = [str(a) for a in request["args"]]
    sys.argv = ["-c", *args]
    set_title(" ".join(["asyncps", *args]))
    return args


def set_title(title: str) -> None:
    """Name the process in `ps` and /proc/PID/cmdline (all children of the server would show its command line);
    nothing where setproctitle (a dependency of the tf extras) is not installed."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(title)


def _log_handlers() -> dict[logging.Logger, set[logging.Handler]]:
    """The handlers of the root logger and of every named logger."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    return {logger: set(logger.handlers) for logger in loggers}


def serve(preload: tuple[str, ...] = PRELOAD) -> list[str] | None:
    """The server's loop: import `preload`, then fork a child per request until stdin closes (None). In a forked
    child it returns that child's CLI arguments."""
    _REPLIES[0] = os.dup(1)
    os.dup2(2, 1)
    set_title(" ".join(["asyncps", *sys.argv[1:]]))  # `asyncps fork-server NAME`
    before = _log_handlers()
    for name in preload:
        importlib.import_module(name)
    for logger, handlers in _log_handlers().items():  # e.g. TensorFlow's own stderr handler: a child configures
        for handler in handlers - before.get(logger, set()):  # its logging as an exec'd process would, from none
            logger.removeHandler(handler)
    gc.collect()
    gc.freeze()  # no child's collection walks (and so copies on write) the pages of what the server imported
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 4096):
                        pass
                _reap()
                continue
            data = os.read(0, 1 << 16)
            if not data:
                selector.close()
                return None
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                args = _fork(json.loads(line), (selector, wake_r, wake_w))
                if args is not None:
                    return args


def _fork(request: dict[str, Any], server_state: tuple[selectors.BaseSelector, int, int]) -> list[str] | None:
    """Fork one child for `request`: in the child, drop the server's state and return its arguments; in the server,
    answer with its pid (or why not) and return None."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        _send({"error": f"fork failed: {exc}"})
        return None
    if pid:
        _send({"pid": pid})
        return None
    selector, wake_r, wake_w = server_state
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    selector.close()
    os.close(wake_r)
    os.close(wake_w)
    os.close(_REPLIES[0])
    return _become(request)
