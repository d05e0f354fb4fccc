"""`asyncps local`: the whole cluster as separate OS processes on 127.0.0.1, with live progress."""

from __future__ import annotations

import datetime
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from asyncps.config import RunConfig, env_name, flag_name, run_options
from asyncps.errors import AsyncpsError
from asyncps.ml.specs import load_problems
from asyncps.net.security import SecurityConfig
from asyncps.procenv import cli_command, process_env
from asyncps.rundir import RunDir, RunSummary, wait_port_file
from asyncps.signals import SignalRoute
from asyncps.tools.forkserver import FORK_SUPPORTED, ForkServer, Process, shared_server
from asyncps.tools.memwatch import MemoryWatch
from asyncps.tools.progress import StatusPoller, display_for
from asyncps.transport import shmseg
from asyncps.transport.grpc_shard import GrpcShardControl, ShardLink

if TYPE_CHECKING:
    from asyncps.tools.progress import StatusSink


BACKUP_SUFFIX = "-backup"  # a shard's backup process is named ps-I-backup (--replicas 2)


def default_run_dir() -> Path:
    """runs/<timestamp> under the current directory."""
    return Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3]


def holds_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds a run: the chief's config.json, or the settings a launcher handed a chief."""
    files = RunDir(run_dir)
    return files.config.exists() or files.launch_config.exists()


def child_env(extra: dict[str, str] | None = None, tf_threads: int = 1) -> dict[str, str]:
    """Environment for cluster processes: asyncps.procenv's allocator and thread settings, quiet TF,
    unbuffered output, no TF_CONFIG (local processes are configured by flags only); then `extra`."""
    env = process_env(intra_op=tf_threads)
    env.pop("TF_CONFIG", None)
    for name in run_options():  # and the launcher's resolved RunConfig: no ASYNCPS_MODE etc. over it
        env.pop(env_name(name), None)
    env.update(extra or {})
    return env


def worker_groups(num_workers: int, processes: int) -> list[tuple[str, int, int]]:
    """(process name, first index, logical workers) per worker process: one each when processes is
    0, else num_workers split into `processes` contiguous blocks of indices (sizes differing by <= 1)."""
    if processes <= 0 or processes >= num_workers:
        return [(f"worker-{i}", i, 1) for i in range(num_workers)]
    groups, first = [], 0
    for p in range(processes):
        count = num_workers // processes + (1 if p < num_workers % processes else 0)
        groups.append((f"workers-{p}", first, count))
        first += count
    return groups


LOG_TAIL_LINES = 15  # what a launcher shows of a process that died: enough for a traceback's end


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` non-empty lines of a log (its last 64 KiB), each indented; '' when it has none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join("    " + line for line in kept)


class ProcessDied(RuntimeError):
    """A process of the cluster exited before it served (the message quotes the end of its log)."""


@dataclass
class Child:
    """One process of the local cluster."""

    name: str
    proc: Process  # a subprocess.Popen (a shard, or any process without the fork server) or a ForkedProcess
    log: IO[bytes]
    terminated: bool = False  # the launcher sent it SIGTERM (stop): a shard then exits 143, as it should

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None

    def failed(self) -> bool:
        """It exited with a status other than 0 and the one SIGTERM gives, when the launcher sent it."""
        code = self.proc.poll()
        by_sigterm = (128 + signal.SIGTERM, -signal.SIGTERM)
        return code is not None and code != 0 and not (self.terminated and code in by_sigterm)


class LocalCluster:
    """Starts and supervises shards, chief and workers; stops them all, always."""

    def __init__(self, run: RunConfig, run_dir: Path, env: dict[str, str] | None = None,
                 resume: bool = False, max_restarts: int = 5, secure: bool = False,
                 client_auth: bool = True, prometheus_port: int = -1, fork: bool = True, replicas: int = 1) -> None:
        if replicas not in (1, 2):
            raise ValueError(f"--replicas is 1 (no backups) or 2 (a backup per shard), got {replicas}")
        self.replicas = replicas
        self.run = run
        # `fork`: the chief and the workers are forked from a server that loaded TensorFlow once
        # (asyncps.tools.forkserver); without it each is a fresh interpreter that loads its own
        self.fork = fork
        self._forkserver: ForkServer | None = None
        self.prometheus_port = prometheus_port  # the chief's Prometheus endpoint (-1: off, 0: any free port)
        self.secure = secure
        self.client_auth = client_auth
        self.security = SecurityConfig()
        self._security_args: dict[str, list[str]] = {}  # per subcommand: ps, chief, worker
        self.resume = resume
        self.max_restarts = max_restarts
        self.restarts: dict[str, int] = {}
        self._given_up: set[str] = set()  # crashed past max_restarts
        self._told: set[str] = set()  # of those, the ones given_up() has named
        self.run_dir = run_dir
        self.files = RunDir(run_dir)
        self.logs = self.files.logs
        # segments of this run are named asyncps-<tag>-..., so stop() can sweep any a worker killed
        # between creating and mapping one left behind
        self.shm_tag = f"run{os.getpid()}x{secrets.token_hex(3)}"
        self.env = child_env({shmseg.TAG_ENV: self.shm_tag, **(env or {})}, run.tf_threads)
        self.children: list[Child] = []
        self.chief_address = ""
        self.ps_addresses: list[str] = []
        self.backups: dict[int, str] = {}  # shard index -> its seeded backup's address (--replicas 2)
        self.takeovers: list[float] = []  # seconds from a primary's death noticed to its backup serving its port
        self._ps_args: dict[str, list[str]] = {}
        self._chief_args: list[str] = []
        self._worker_args: dict[str, list[str]] = {}
        self._timeout_args = [flag_name("chief_timeout_s"), f"{run.chief_timeout_s:g}"]
        # the shards import the plugin modules this run's rule names, and no other a request might name
        plugins = run.update_rule().plugin_modules()
        self._plugin_args = ["--plugins", ",".join(plugins)] if plugins else []

    def _spawn(self, name: str, args: list[str]) -> Child:
        log = open(self.files.log(name), "ab")  # noqa: SIM115 - closed in stop(); appended on restarts
        full_args = [*args, *self._security_args.get(args[0], [])]
        proc: Process | None = None
        if self._forkserver is not None and args[0] != "ps":  # a shard needs no TensorFlow: exec'd
            proc = self._forkserver.spawn(full_args, self.env, self.files.log(name))
        if proc is None:
            proc = subprocess.Popen(
                cli_command(*full_args), stdout=log, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True,  # Ctrl-C reaches the launcher, which stops them in order
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def start(self, port_timeout_s: float = 120.0) -> None:
        """Start N shards, then the chief and M workers together; wait until each server has a port."""
        self.logs.mkdir(parents=True, exist_ok=True)
        if self.secure:
            self._make_secrets()
        config_file = self.files.launch_config
        config_file.write_text(self.run.to_json())
        if self.fork and FORK_SUPPORTED and self._forkserver is None:  # a new one imports while the shards start
            self._forkserver = shared_server(self.env, per_request=(shmseg.TAG_ENV,))
        shards = []
        for i in range(self.run.num_ps):
            port_file = self.files.port_file(f"ps-{i}")
            port_file.unlink(missing_ok=True)
            shards.append((self._spawn(f"ps-{i}", ["ps", "--host", "127.0.0.1", "--port", "0", "--index", str(i),
                                                  "--chunk-bytes", str(self.run.chunk_bytes), *self._timeout_args,
                                                  *self._plugin_args, "--port-file", str(port_file)]), port_file))
        for child, port_file in shards:
            port = self._wait_port(child, port_file, port_timeout_s)
            self.ps_addresses.append(f"127.0.0.1:{port}")
            self._ps_args[child.name] = ["ps", "--host", "127.0.0.1", "--port", str(port),
                                         "--index", child.name.split("-")[1],
                                         "--chunk-bytes", str(self.run.chunk_bytes), *self._timeout_args,
                                         *self._plugin_args]
        if self.replicas > 1:  # before the chief initializes them: a backup holds every state change
            for i in range(self.run.num_ps):
                self._start_backup(i, port_timeout_s)
        port_file = self.files.port_file("chief")
        port_file.unlink(missing_ok=True)
        args = ["chief", "--host", "127.0.0.1", "--ps", ",".join(self.ps_addresses),
                "--num-workers", str(self.run.num_workers), "--run-dir", str(self.run_dir),
                "--run-config", str(config_file), *(["--resume"] if self.resume else []),
                *(["--prometheus-port", str(self.prometheus_port),
                   "--prometheus-port-file", str(self.files.port_file("chief.metrics"))]
                  if self.prometheus_port >= 0 else [])]
        chief = self._spawn("chief", [*args, "--port", "0", "--port-file", str(port_file)])
        # the workers start now, beside the chief: each loads TensorFlow while the chief loads its own, then
        # reads the chief's port from its port file (a restarted worker finds it there at once)
        for name, first, count in worker_groups(self.run.num_workers, self.run.worker_processes):
            # a restarted worker asks for the same index: the chief re-queues its predecessor's tasks
            self._worker_args[name] = ["worker", "--chief-port-file", str(port_file), "--index", str(first),
                                       *(["--logical", str(count)] if count > 1 else []), *self._timeout_args]
            self._spawn(name, self._worker_args[name])
        port = self._wait_port(chief, port_file, port_timeout_s)
        self.chief_address = f"127.0.0.1:{port}"
        self._chief_args = [*args, "--port", str(port)]  # a restarted chief serves where the workers look

    def _wait_port(self, child: Child, port_file: Path, timeout_s: float) -> int:
        """The port `child` published; ProcessDied (with the end of its log) when it exited first or
        published none in time."""
        try:
            return wait_port_file(port_file, timeout_s, child.alive)
        except RuntimeError:
            raise ProcessDied(self.last_words(child, "exited with status {code} before it served")) from None
        except TimeoutError:
            raise ProcessDied(self.last_words(child, f"served no port within {timeout_s:.0f}s")) from None

    def last_words(self, child: Child, what: str) -> str:
        """`<name> <what>; the end of its log <path>:` and the log's last lines (`{code}` in `what`: the exit
        status)."""
        log = self.files.log(child.name)
        tail = log_tail(log)
        said = f"; the end of its log {log}:\n{tail}" if tail else f"; its log {log} is empty"
        return f"{child.name} {what.format(code=child.proc.poll())}{said}"

    def _make_secrets(self) -> None:
        """A development CA, a certificate per role (shards, chief, workers) and a token per role:
        a worker's credentials cannot call the shards' chief-only methods."""
        from asyncps.tools.devcerts import CHIEF_COMMON_NAME, SERVER_COMMON_NAME, cert_paths, generate_dev_certs

        secrets_dir = self.files.secrets
        secrets_dir.mkdir(mode=0o700, exist_ok=True)
        certs = cert_paths(secrets_dir) if (secrets_dir / "chief.pem").exists() else \
            generate_dev_certs(secrets_dir, overwrite=True)
        token_file, chief_token_file = secrets_dir / "token", secrets_dir / "chief-token"
        for file in (token_file, chief_token_file):
            if not file.exists():
                file.write_text(secrets.token_urlsafe(32) + "\n")
                file.chmod(0o600)
        tls_mode = [] if self.client_auth else ["--tls-no-client-auth"]
        tokens = ["--token-file", str(token_file)]
        chief_tokens = [*tokens, "--chief-token-file", str(chief_token_file)]
        # --replicas 2: a primary forwards the chief's calls to its backup (asyncps.ps.replica) with the shards'
        # certificate and the chief's token, which every shard holds already (it checks the chief's calls with it):
        # the shards take that certificate's name for a chief's too; workers have neither
        ps_tokens = [*chief_tokens, "--chief-identity", f"{CHIEF_COMMON_NAME},{SERVER_COMMON_NAME}"] \
            if self.replicas > 1 else chief_tokens
        self._security_args = {
            role: [*role_tokens, "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(certs.ca_cert),
                   *tls_mode]
            for role, role_tokens, cert, key in (
                ("ps", ps_tokens, certs.server_cert, certs.server_key),
                ("chief", chief_tokens, certs.chief_cert, certs.chief_key),
                ("worker", tokens, certs.client_cert, certs.client_key))}
        self.security = SecurityConfig.from_flags(str(token_file), str(certs.chief_cert), str(certs.chief_key),
                                                  str(certs.ca_cert), require_client_cert=self.client_auth,
                                                  chief_token_file=str(chief_token_file))

    def _start_backup(self, index: int, port_timeout_s: float = 120.0) -> str | None:
        """Start shard `index`'s backup (`ps-I-backup`) and have its primary forward to it, its whole state
        first (asyncps.ps.replica); its address, or None when it could not be seeded (its primary is gone or
        refused: the process is stopped, and the shard goes on without a backup, saying so)."""
        name = f"ps-{index}{BACKUP_SUFFIX}"
        port_file = self.files.port_file(name)
        port_file.unlink(missing_ok=True)
        # no chief watch: the chief never calls a backup (its primary does) until it takes over
        child = self._spawn(name, ["ps", "--host", "127.0.0.1", "--port", "0", "--index", str(index),
                                   "--chunk-bytes", str(self.run.chunk_bytes), flag_name("chief_timeout_s"), "0",
                                   *self._plugin_args, "--port-file", str(port_file)])
        try:
            address = f"127.0.0.1:{self._wait_port(child, port_file, port_timeout_s)}"
            link = ShardLink(self.ps_addresses[index], deadline_s=5.0, security=self.security)
            with closing(GrpcShardControl(link)) as primary:
                primary.set_backup(address)
        except (ProcessDied, AsyncpsError) as exc:
            print(f"\nasyncps local: ps-{index} has no backup for now: {exc}", file=sys.stderr)
            child.proc.kill()
            child.proc.wait()
            child.log.close()
            self.children.remove(child)
            return None
        self.backups[index] = address
        return address

    def restart_dead_shards(self) -> list[str]:
        """Start again, on the same port, every shard that died (the chief restores its state); with backups
        (--replicas 2), a dead primary's backup takes over its port instead, with every push it answered, and
        a new backup is started for it; a dead backup is replaced (seeded from its primary)."""
        restarted = []
        for child in list(self.children):
            if not child.name.startswith("ps-") or child.proc.poll() in (None, 0):
                continue
            index = int(child.name.removeprefix("ps-").removesuffix(BACKUP_SUFFIX))
            backup = next((c for c in self.children if c.name == f"ps-{index}{BACKUP_SUFFIX}"), None)
            if child.name.endswith(BACKUP_SUFFIX):
                if self._within_restarts(child):
                    self.children.remove(child)
                    child.log.close()
                    self._start_backup(index)
                    restarted.append(f"{child.name} died; started a new backup, seeded from its primary")
            elif backup is not None and backup.alive() and index in self.backups and self._within_restarts(child):
                started = time.monotonic()
                port = int(self.ps_addresses[index].rpartition(":")[2])
                try:
                    link = ShardLink(self.backups[index], deadline_s=5.0, security=self.security)
                    with closing(GrpcShardControl(link)) as control:
                        control.promote(port)
                except AsyncpsError as exc:  # the backup went too: the shard restarts, the chief restores it
                    print(f"\nasyncps local: ps-{index}'s backup could not take over: {exc}", file=sys.stderr)
                    del self.backups[index]
                    self._replace(child)  # its restart is counted already
                    restarted.append(child.name)
                    continue
                self.children.remove(child)
                child.log.close()
                backup.name = child.name  # the backup is the primary now, where the primary served
                del self.backups[index]  # until a new one is seeded
                self.takeovers.append(time.monotonic() - started)
                self._start_backup(index)
                restarted.append(f"{child.name} died; its backup took over its port in {self.takeovers[-1]:.2f}s "
                                 "with every push it answered, and a new backup started")
            elif self._restart(child):
                restarted.append(child.name)
                if self.replicas > 1 and (backup is None or not backup.alive()):
                    self.backups.pop(index, None)
                    self._start_backup(index)  # seeded from the restarted shard once the chief restored it
        return restarted

    def _within_restarts(self, child: Child) -> bool:
        """Count one restart of `child`'s name: False (given up) past max_restarts."""
        count = self.restarts.get(child.name, 0)
        if count >= self.max_restarts:
            self._given_up.add(child.name)
            return False
        self.restarts[child.name] = count + 1
        return True

    def restart_dead_workers(self) -> list[str]:
        """Start again every worker process that crashed (exited non-zero or was killed), under the
        same index: the chief re-queues the data tasks its previous incarnation held."""
        restarted = []
        for child in list(self.children):
            if child.name in self._worker_args and child.proc.poll() not in (None, 0) and self._restart(child):
                restarted.append(child.name)
        return restarted

    def restart_dead_chief(self) -> bool:
        """Start the chief again, on the same port, if it died (it resumes the run); True if restarted.

        A chief that exited with one of its final codes (done, or an error a restart cannot fix) stays down.
        With it, every shard that is not running starts again (one the dead chief shut down exited 0)."""
        from asyncps.chief.lifecycle import FINAL_EXIT_CODES

        chief = self.chief
        if chief.proc.poll() in (None, *FINAL_EXIT_CODES) or not self._restart(chief):
            return False
        # a shard the dead chief told to exit (exit 0) is needed by the run it resumes: started again
        # on its port, empty, it gets the latest checkpoint from the new chief
        for child in list(self.children):  # (a backup that exited is the next takeover's business, not the chief's)
            if child.name.startswith("ps-") and not child.name.endswith(BACKUP_SUFFIX) and not child.alive():
                self._restart(child)
        return True

    def given_up(self) -> list[str]:
        """The processes that crashed once more than max_restarts allows, each named once (the first time asked)."""
        new = sorted(self._given_up - self._told)
        self._told.update(new)
        return new

    def _restart(self, child: Child) -> bool:
        """Replace a dead child by a new process with its arguments (within max_restarts per name)."""
        if not self._within_restarts(child):
            return False
        self._replace(child)
        return True

    def _replace(self, child: Child) -> None:
        """A new process in a dead child's place, with its arguments (the restart already counted)."""
        child.log.close()
        i = self.children.index(child)
        self.children.pop(i)
        args = (self._chief_args if child.name == "chief" else self._worker_args[child.name]
                if child.name in self._worker_args else self._ps_args[child.name])
        replacement = self._spawn(child.name, args)
        self.children.remove(replacement)
        self.children.insert(i, replacement)

    @property
    def chief(self) -> Child:
        """The chief process."""
        return next(c for c in self.children if c.name == "chief")

    def interrupt(self) -> None:
        """Ask the chief to stop the run gracefully (it then stops workers and shards)."""
        for child in self.children:
            if child.name == "chief" and child.alive():
                child.proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 15.0) -> None:
        """Wait for every process to exit on its own, then terminate, then kill what is left."""
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.terminated = True
                child.proc.terminate()
        for child in self.children:
            try:
                child.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            child.log.close()
        self._forkserver = None  # shared: it stays for this process's next cluster
        shmseg.sweep(self.shm_tag)

    def live_processes(self) -> list[tuple[str, int]]:
        """(name, pid) of every live process of the cluster: the children, and the fork server (`fork-server`, shared
        with this process's other clusters), which holds the TensorFlow its children share."""
        live = [(c.name, c.proc.pid) for c in self.children if c.alive()]
        server = self._forkserver.pid if self._forkserver is not None else None
        return live + ([("fork-server", server)] if server is not None else [])

    def exit_codes(self) -> dict[str, int | None]:
        """Exit code of every process (None while running)."""
        return {c.name: c.proc.poll() for c in self.children}


def run_local(run: RunConfig, run_dir: Path, progress: bool = True,
              env: dict[str, str] | None = None, resume: bool = False, secure: bool = False,
              client_auth: bool = True, sink: StatusSink | None = None, prometheus_port: int = -1,
              max_restarts: int = 5, quiet: bool = False, fork: bool = True, replicas: int = 1) -> int:
    """Run a whole local cluster to completion (`replicas` 2: a backup per shard, which takes over when its
    primary dies: asyncps.ps.replica); return the chief's exit code. The run's status goes
    to `sink`, else (with `progress`) to a progress bar or status lines on stdout. ValueError, before
    any process starts, for a spec that does not load (a user function that does not import, a
    missing npz file), instead of a process that exits before publishing its port. `quiet`: none of its own
    lines on stdout (the run's start, end, memory and directory: asyncps.train's verbose=0); errors still go to
    stderr. `fork`: the chief and the workers forked from one process that loaded TensorFlow once
    (asyncps.tools.forkserver), else each a fresh interpreter."""
    say = (lambda *_args, **_kwargs: None) if quiet else print
    problems = load_problems(run.model, run.dataset, run.loss, run.eval_metrics)
    if problems:
        raise ValueError("; ".join(problems))
    run_dir.mkdir(parents=True, exist_ok=True)
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, got {max_restarts}")
    cluster = LocalCluster(run, run_dir, env, resume=resume, secure=secure, client_auth=client_auth,
                           prometheus_port=prometheus_port, max_restarts=max_restarts, fork=fork, replicas=replicas)
    interrupted = threading.Event()

    def on_signal(signum: int) -> None:  # run by the route's thread, not in the signal handler
        if interrupted.is_set():  # second Ctrl-C: no more grace
            for child in cluster.children:
                child.proc.kill()
        interrupted.set()
        cluster.interrupt()

    route = SignalRoute({signal.SIGINT: on_signal, signal.SIGTERM: on_signal}).install()
    poller: StatusPoller | None = None
    memory = MemoryWatch()
    shown = False  # a dead process's last lines were shown already
    try:
        where = f" in {run.worker_processes} processes" if 0 < run.worker_processes < run.num_workers else ""
        backed = " (each with a backup)" if replicas > 1 else ""
        say(f"asyncps local: {run.num_ps} shards{backed}, {run.num_workers} workers{where}, {run.model} on "
            f"{run.dataset}, mode {run.mode}; run directory {run_dir}", flush=True)
        cluster.start()
        if sink is None and progress:
            sink = display_for(sys.stdout)
        poller = StatusPoller(cluster.chief_address, cluster.security, timeout_s=1.0) if sink else None
        while True:
            status = poller.try_poll() if poller else None
            if sink and status is not None:
                sink.show(status)
            memory.sample(cluster.live_processes())
            time.sleep(0.5)
            if interrupted.is_set():
                if not cluster.chief.alive():
                    break
                continue
            # a shard that exits 0 was told to by the chief; any other exit is a crash: restart it
            # on its port and the chief restores its part of the latest checkpoint
            for name in cluster.restart_dead_shards():
                print(f"\nasyncps local: {name}" if " " in name else
                      f"\nasyncps local: {name} died; restarted it (the chief restores it)", file=sys.stderr)
            # a worker that crashed comes back under its index (up to max_restarts times each); the
            # chief re-queues the tasks its previous incarnation held
            if cluster.chief.alive():
                for name in cluster.restart_dead_workers():
                    print(f"\nasyncps local: {name} died; restarted it (restart {cluster.restarts[name]} of "
                          f"{cluster.max_restarts})", file=sys.stderr)
            # a chief killed or crashed comes back on its port and resumes the run from the live shards
            chief_back = cluster.restart_dead_chief()
            if chief_back:
                print("\nasyncps local: the chief died; restarted it (it resumes the run)", file=sys.stderr)
            for name in cluster.given_up():
                print(f"\nasyncps local: {name} crashed with its {cluster.max_restarts} restarts used "
                      f"(--max-restarts {cluster.max_restarts}): not restarted", file=sys.stderr)
            if not chief_back and not cluster.chief.alive():
                break
    except ProcessDied as exc:
        print(f"asyncps local: {exc}", file=sys.stderr)
        shown = True  # and the rest need not finish: without a chief (or a shard) no run will
    except (TimeoutError, RuntimeError) as exc:
        print(f"asyncps local: {exc}; see {cluster.logs}", file=sys.stderr)
    finally:
        if sink:
            sink.close()
        if poller:
            poller.close()
        cluster.stop(grace_s=0.0 if shown else 15.0)
        route.restore()
    mem = memory.write(run_dir, run.num_workers)
    codes = cluster.exit_codes()
    failed = {c.name: codes[c.name] for c in cluster.children if c.failed()}
    if failed:
        print(f"asyncps local: non-zero exits {failed}; logs in {cluster.logs}", file=sys.stderr)
        if codes.get("chief") not in (0, None) and not shown:
            print(f"asyncps local: {cluster.last_words(cluster.chief, 'exited with status {code}')}", file=sys.stderr)
    if RunDir(run_dir).summary.exists():
        s = RunSummary.load(run_dir)
        skipped = (f", {s.nonfinite_steps} non-finite steps skipped" if s.nonfinite_steps else "") + (
            f", {s.checkpoints_failed} checkpoint(s) not written (see logs/chief.log)" if s.checkpoints_failed else "")
        say(f"done: {s.updates_applied} updates in {s.wall_s:.1f}s ({s.throughput_updates_per_s:.1f}/s), "
              f"{final_eval_text(s)}, mean staleness {s.staleness.mean:.2f}{skipped}")
        if s.verdict:
            print(f"asyncps local: ERROR: the run did not train: {s.verdict}", file=sys.stderr)
    say(f"peak memory: workers {mem.workers_total_mb:.0f} MB ({mem.per_worker_mb:.1f} MB per worker), "
        f"all processes {mem.total_mb:.0f} MB")
    say(f"run directory: {run_dir}")
    chief_code = codes.get("chief")
    return 1 if chief_code is None else chief_code


def final_eval_text(s: RunSummary) -> str:
    """The final evaluation in words: the test accuracy of a classification run, else the test loss and
    the task's metrics."""
    if not math.isnan(s.final_eval.accuracy):
        return f"final test accuracy {s.final_eval.accuracy:.4f}"
    return f"final test loss {s.final_eval.loss:.4g}" + "".join(f", {k} {v:.4g}" for k, v in s.metrics.items())


__all__ = ["LocalCluster", "ProcessDied", "final_eval_text", "log_tail", "run_local"]
