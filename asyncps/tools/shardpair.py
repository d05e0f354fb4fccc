"""`asyncps ps --replicas 2`: one shard as a pair of processes, its primary and its backup, in the container, pod
or node the command runs in: replicated shards where `asyncps local`'s launcher is not there to do it (compose,
Swarm, Kubernetes, Slurm, TF_CONFIG).

The command starts the shard (the primary, serving on the shard's port as a plain `asyncps ps` would) and its
backup (on a free port of the same host: no chief watch, no health port, a data port of its own), has the
primary forward every state change to the backup before it answers (SetBackup: asyncps.ps.replica), publishes
the shard's port (`--port-file`) once the backup is seeded, and watches both twice a second, as
`asyncps local --replicas 2` does:
- the primary dies (a crash, kill -9, the kernel's OOM killer): the backup takes over the shard's port (Promote)
  with every push the primary answered; the workers and the chief find the shard where it was, and a new backup
  is started and seeded from it, its whole state first;
- the backup dies: a new one is started and seeded from the primary (MAX_BACKUP_STARTS in all; past them the
  shard goes on alone and says so);
- the primary exits 0 (the chief's Shutdown, which ends its backup too) or 3 (the chief silent too long): the
  pair exits with its code, its backup stopped;
- SIGTERM or SIGINT stops both; the command then exits as `asyncps ps` does (143 after SIGTERM).

A pair shares its container, pod or node: losing that loses both, and the chief restores the shard from its
latest checkpoint, as without replicas. A backup taken over has no chief watch (it never had one: the chief
does not call it before the takeover).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from asyncps.errors import AsyncpsError
from asyncps.net.security import SecurityConfig
from asyncps.procenv import cli_command
from asyncps.rundir import wait_port_file, write_port_file
from asyncps.transport.grpc_shard import GrpcShardControl, ShardLink

log = logging.getLogger("asyncps.ps")

POLL_S = 0.5  # how often the pair looks at its processes
START_TIMEOUT_S = 120.0  # for a process to serve its port
EXIT_CHIEF_SILENT = 3  # asyncps.ps.main.run_ps: the chief was silent too long
MAX_BACKUP_STARTS = 5  # backups started after the first, in all
_ANY_HOST = ("", "0.0.0.0", "::", "[::]")


@dataclass
class _Proc:
    role: str  # "primary" or "backup"
    popen: subprocess.Popen[bytes]
    port: int = 0

    def alive(self) -> bool:
        return self.popen.poll() is None


def reach(host: str, port: int) -> str:
    """The address at which a process of this host bound to `host`:`port` is called."""
    if host in _ANY_HOST:
        return f"127.0.0.1:{port}"
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class ShardPair:
    """Starts and watches a shard's primary and backup processes (see the module's doc)."""

    def __init__(self, argv: Sequence[str], host: str, port: int, index: int, port_file: str,
                 security: SecurityConfig, data_port: int = -1) -> None:
        # argv: this command's own (`ps ...`): each process gets it with what differs put after (the last wins)
        self._argv, self._host, self._port, self._index = list(argv), host, port, index
        self._port_file, self._security, self._data_port = port_file, security, data_port
        self._dir = Path(tempfile.mkdtemp(prefix=f"asyncps-ps{index}-pair-"))
        self._serial = 0
        self.backup_starts = 0
        self.takeovers = 0

    def _start(self, role: str, port: int, extra: Sequence[str] = ()) -> _Proc | None:
        """Start a process and wait for its port; None (logged) when it exited or served none in time."""
        self._serial += 1
        port_file = self._dir / f"{role}-{self._serial}.port"
        args = [*self._argv, "--replicas", "1", "--index", str(self._index), "--port", str(port),
                "--port-file", str(port_file), *extra]
        proc = _Proc(role, subprocess.Popen(cli_command(*args), start_new_session=True))  # signals: ours to forward
        try:
            proc.port = wait_port_file(port_file, START_TIMEOUT_S, proc.alive)
        except (RuntimeError, TimeoutError) as exc:
            log.error("shard %d: its %s did not start: %s (exit status %s)", self._index, role, exc, proc.popen.poll())
            _stop(proc, kill=True)
            return None
        return proc

    def _start_backup(self, primary: _Proc) -> _Proc | None:
        """A new backup, seeded from `primary` (its whole state first); None when it could not be."""
        data = ["--data-port", "0"] if self._data_port > 0 else []  # the primary's is taken: one of its own
        backup = self._start("backup", 0, ["--chief-timeout-s", "0", "--health-port", "off", *data])
        if backup is None:
            return None
        try:
            with closing(GrpcShardControl(ShardLink(reach(self._host, primary.port), deadline_s=10.0,
                                                    security=self._security))) as control:
                version = control.set_backup(reach(self._host, backup.port))
        except AsyncpsError as exc:
            log.warning("shard %d has no backup for now: it could not be seeded: %s", self._index, exc)
            _stop(backup, kill=True)
            return None
        log.info("shard %d: its backup (pid %d, port %d) is seeded at version %d", self._index, backup.popen.pid,
                 backup.port, version)
        return backup

    def _promote(self, backup: _Proc) -> bool:
        """Have `backup` take over the shard's port; False when it could not."""
        try:
            with closing(GrpcShardControl(ShardLink(reach(self._host, backup.port), deadline_s=5.0,
                                                    security=self._security))) as control:
                control.promote(self._port)
        except AsyncpsError as exc:
            log.error("shard %d: its backup could not take over: %s", self._index, exc)
            return False
        self.takeovers += 1
        return True

    def run(self, stop: threading.Event) -> int:
        """Serve as one shard until the primary ends the run or `stop` is set; the exit code (see the module's doc)."""
        primary: _Proc | None = None
        backup: _Proc | None = None
        try:
            primary = self._start("primary", self._port)
            if primary is None:
                return 1
            self._port = primary.port
            backup = self._start_backup(primary)
            write_port_file(self._port_file, primary.port)
            log.info("shard %d serves on port %d as a pair: primary pid %d, %s", self._index, primary.port,
                     primary.popen.pid, f"backup pid {backup.popen.pid}" if backup else "no backup")
            while not stop.wait(POLL_S):
                code = primary.popen.poll()
                if code is not None:
                    if code in (0, EXIT_CHIEF_SILENT) or backup is None or not backup.alive() \
                            or not self._promote(backup):
                        log.log(logging.INFO if code == 0 else logging.ERROR,
                                "shard %d: its primary exited with status %d%s", self._index, code,
                                "" if code in (0, EXIT_CHIEF_SILENT) else ", and no backup took over")
                        if backup is not None and code == 0:  # the chief's Shutdown ends the backup too
                            _stop(backup, wait_s=10.0)
                        return code
                    log.warning("shard %d: its primary (pid %d) died with status %d; its backup (pid %d) took over "
                                "port %d with every push it answered", self._index, primary.popen.pid, code,
                                backup.popen.pid, self._port)
                    primary, backup = backup, None
                    primary.port = self._port
                if backup is not None and not backup.alive():
                    log.warning("shard %d: its backup (pid %d) exited with status %s", self._index,
                                backup.popen.pid, backup.popen.poll())
                    backup = None
                if backup is None and self._may_start_backup():
                    backup = self._start_backup(primary)
            return 0
        finally:
            for proc in (primary, backup):
                if proc is not None:
                    _stop(proc)
            shutil.rmtree(self._dir, ignore_errors=True)

    def _may_start_backup(self) -> bool:
        """Count a backup start; False past MAX_BACKUP_STARTS (said once)."""
        if self.backup_starts >= MAX_BACKUP_STARTS:
            if self.backup_starts == MAX_BACKUP_STARTS:
                log.error("shard %d goes on without a backup: %d backups were started already", self._index,
                          MAX_BACKUP_STARTS + 1)
                self.backup_starts += 1
            return False
        self.backup_starts += 1
        return True


def _stop(proc: _Proc, wait_s: float = 10.0, kill: bool = False) -> None:
    """Stop a process (SIGTERM, then SIGKILL after `wait_s`; SIGKILL at once with `kill`) and reap it."""
    if proc.popen.poll() is None:
        (proc.popen.kill if kill else proc.popen.terminate)()
    try:
        proc.popen.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        proc.popen.wait()


__all__ = ["MAX_BACKUP_STARTS", "ShardPair", "reach"]
