"""Baseline measurements that asyncps is compared against.

Three baselines, all on the same synthetic workload (an MLP ``784 -> hidden... -> 10`` trained
with plain SGD on random 784-feature / 10-class data, so nothing is downloaded):

* :func:`keras_local_loop`: the plain single-process Keras loop (``GradientTape`` step inside
  ``tf.function``): the "no distribution at all" reference.
* :func:`tf_ps_strategy`: TensorFlow's own ``tf.distribute.ParameterServerStrategy`` driven by
  a ``ClusterCoordinator``, with ``num_ps`` PS and ``num_workers`` worker servers as separate
  OS processes on 127.0.0.1: the closest off-the-shelf equivalent of asyncps.
* :func:`raw_grpc_streaming`: raw gRPC byte streaming through a generic handler (no protobuf
  schema): the transport ceiling any gRPC-based parameter server lives under.

Process layout. Every TensorFlow measurement runs in fresh child processes
(``benchmarks/_tf_child.py``), including the local loop and the PS coordinator, because

* TF thread-pool sizes can only be set before TF's runtime initialises, and the glibc
  ``MALLOC_*`` tunables (:data:`asyncps.procenv.MALLOC_ENV`, the one setting of every process
  the project starts) are only read at process start;
* ``ParameterServerStrategy`` installs a process-global remote eager context pointing at the
  cluster, which must not leak into the caller (who may run asyncps or another cluster next);
* the numbers then do not depend on what the calling process did before.

The gRPC server likewise runs in a child (``benchmarks/_grpc_child.py``); the gRPC client runs
in the calling process. ``python -m benchmarks.baselines`` re-executes itself with
``MALLOC_ENV`` applied (see :func:`reexec_with_tuned_malloc`) so that the client side
gets the same allocator settings. Children are always killed on exit, exceptions and
timeouts, and additionally exit on their own once the benchmark process is gone.

Thread settings: one rule for every contender (:func:`compute_threads`): the machine's cores
are shared out evenly over the processes that compute gradients, so each of them gets
``intra_op = max(1, cores // compute processes)``; every other process gets 1. Every child's
environment comes from :func:`asyncps.procenv.process_env` with its thread counts
(``TF_NUM_*_THREADS``, ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``), and TF children also set
the same counts through ``tf.config`` / ``ConfigProto``. On the 2-core machine:

* local loop: ``intra_op=2`` (the one computing process gets both cores), ``inter_op=1`` (the
  MLP step is a single dependency chain, so parallel op scheduling only adds contention);
* PS strategy: workers ``intra_op=1`` (two workers = two cores) with ``inter_op=num_workers +
  1``: remote-variable reads block inter-op threads, and with ``inter_op=1`` the workers hang
  (reproduced here: no result within minutes; TF's own tutorial uses the same
  ``num_workers + 1`` rule on small machines); PS tasks and the coordinator ``intra_op=1``
  (they only apply element-wise SGD updates and dispatch RPCs), ``inter_op`` left at TF's
  default. Giving everything ``intra_op=2`` or the workers more inter-op threads measured no
  better (within this shared machine's noise);
* asyncps (benchmarks.asyncps_runs): ``--tf-threads`` (intra and inter) of the workers and the
  chief by the same rule.

PS-strategy measurement details: ``ClusterCoordinator.schedule`` never blocks in practice
(its queue holds 256Ki closures), so the coordinator keeps at most 4 steps per worker in
flight, and the scheduled step returns nothing (waiting on a returned loss costs an extra
coordinator RPC per step, ~15-20 % of throughput on the small model).

The load average that ``main`` prints includes the benchmark's own processes; on a shared
machine, run it when nothing else is busy.

Units: ``MB`` is 10**6 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import select
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import grpc

from asyncps.procenv import MALLOC_ENV, has_malloc_env, process_env
from benchmarks import _grpc_child

__all__ = [
    "BaselineError",
    "Samples",
    "compute_threads",
    "keras_local_loop",
    "raw_grpc_streaming",
    "reexec_with_tuned_malloc",
    "tf_ps_strategy",
]

MB = 1_000_000
_MIB = 1 << 20

_HERE = Path(__file__).resolve().parent
_TF_CHILD = _HERE / "_tf_child.py"
_GRPC_CHILD = _HERE / "_grpc_child.py"
_TCP_CHILD = _HERE / "_tcp_child.py"

#: TF inter-op threads of the local-loop process (see module docstring).
DEFAULT_LOCAL_INTER_OP = 1

#: Seconds a child gets to import TensorFlow / start serving. TF's import alone takes 5-25 s
#: on this 2-core machine depending on load, and several children start at once.
_STARTUP_TIMEOUT_S = 240.0
#: Fixed warm-up step counts (tf.function tracing, first RPCs, allocator warm-up).
_LOCAL_WARMUP_STEPS = 20
_PS_WARMUP_STEPS = 40


class BaselineError(RuntimeError):
    """A baseline child process failed, exited early or timed out."""


@dataclass(frozen=True)
class Samples:
    """Repeated measurements of one benchmark: one value per repetition."""

    name: str
    unit: str
    values: list[float]

    @property
    def median(self) -> float:
        """Median over repetitions."""
        return float(statistics.median(self.values))

    @property
    def min(self) -> float:
        """Smallest repetition."""
        return min(self.values)

    @property
    def max(self) -> float:
        """Largest repetition."""
        return max(self.values)

    def summary(self) -> str:
        """One line: ``name: median unit (min-max, n=...)``."""
        return (
            f"{self.name}: {self.median:.1f} {self.unit} "
            f"(min-max {self.min:.1f}-{self.max:.1f}, n={len(self.values)})"
        )


def compute_threads(compute_processes: int, cpus: int | None = None) -> int:
    """TF ``intra_op`` threads of each of ``compute_processes`` gradient-computing processes.

    The one thread rule of every contender: the machine's ``cpus`` (default: all) are shared
    out evenly, at least one thread each.
    """
    if compute_processes < 1:
        raise ValueError("compute_processes must be >= 1")
    return max(1, (cpus or os.cpu_count() or 1) // compute_processes)


def malloc_is_tuned(environ: dict[str, str] | None = None) -> bool:
    """Whether ``environ`` (default: ``os.environ``) already carries ``MALLOC_ENV``."""
    return has_malloc_env(environ)


def reexec_with_tuned_malloc() -> None:
    """Re-execute the current interpreter command line with ``MALLOC_ENV`` applied.

    A no-op when the variables are already set (so it cannot loop); otherwise it does not
    return. Call it first thing in a benchmark ``main`` so in-process clients get the same
    allocator behaviour as the child processes.
    """
    if has_malloc_env():
        return
    env = {**os.environ, **MALLOC_ENV}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _free_ports(count: int) -> list[int]:
    """Return ``count`` distinct currently-free TCP ports on 127.0.0.1.

    TF servers need their address before they start, so bind port 0, read the port back and
    release it (all sockets are held until every port is picked, so they are distinct).
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


class _Child:
    """One child process: stdout is a pipe we parse, stderr goes to a temporary log file."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str]) -> None:
        self.name = name
        # Closed in kill(); its lifetime is the child's, not a block's.
        self._log: IO[bytes] = tempfile.TemporaryFile(  # noqa: SIM115
            prefix=f"asyncps-bench-{name}-"
        )
        self._buffer = b""
        try:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=self._log,
                env=env,
                # Own session: a terminal Ctrl-C reaches only us, and we clean up children.
                start_new_session=True,
            )
        except BaseException:
            self._log.close()
            raise

    def log_tail(self, limit: int = 3000) -> str:
        """Return the last ``limit`` characters the child wrote to stderr."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-limit:]

    def _fail(self, what: str) -> BaselineError:
        return BaselineError(f"{self.name}: {what}; stderr tail:\n{self.log_tail()}")

    def read_tagged_line(self, tag: str, timeout: float) -> str:
        """Wait for a stdout line ``"<tag> <payload>"`` (or just ``tag``); return the payload."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        prefix = tag.encode()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                if line == prefix or line.startswith(prefix + b" "):
                    return line[len(prefix) :].strip().decode()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(f"no {tag!r} line within {timeout:.0f} s")
            ready, _, _ = select.select([fd], [], [], min(remaining, 1.0))
            if ready:
                data = os.read(fd, 1 << 16)
                if not data:
                    rc = self.proc.wait()
                    raise self._fail(f"exited with status {rc} before printing {tag!r}")
                self._buffer += data

    def kill(self) -> None:
        """Kill the child (if still running), reap it and drop its log."""
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class _Children(contextlib.AbstractContextManager["_Children"]):
    """Starts child processes and guarantees they are all killed when the block exits."""

    def __init__(self) -> None:
        self._children: list[_Child] = []

    def start(self, name: str, argv: Sequence[str], intra_op: int = 1, inter_op: int = 0) -> _Child:
        """Start ``argv`` as a tracked child named ``name``, its environment from
        :func:`asyncps.procenv.process_env` with these thread counts (0: the library default)."""
        child = _Child(name, argv, process_env(intra_op=intra_op, inter_op=inter_op))
        self._children.append(child)
        return child

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for child in reversed(self._children):
            child.kill()
        self._children.clear()


def _tf_child_argv(role: str, **kwargs: Any) -> list[str]:
    return [sys.executable, str(_TF_CHILD), role, json.dumps(kwargs)]


def _model_name(hidden: Sequence[int]) -> str:
    return "-".join(str(n) for n in (784, *hidden, 10))


def keras_local_loop(
    hidden: tuple[int, ...],
    batch: int = 64,
    repeats: int = 5,
    seconds: float = 3.0,
    *,
    intra_op: int | None = None,
    inter_op: int = DEFAULT_LOCAL_INTER_OP,
) -> Samples:
    """Measure a plain single-process Keras training loop in steps/s.

    MLP ``784 -> hidden... -> 10`` (ReLU), SGD (lr 0.01), sparse softmax cross-entropy, one
    ``GradientTape`` step per ``tf.function`` call on a fixed synthetic batch of ``batch``
    rows. After a warm-up, each of the ``repeats`` repetitions steps for ``seconds`` and
    yields one steps/s value. Runs in a fresh child process with ``intra_op`` / ``inter_op``
    TF threads (0 = TF's default; ``intra_op`` by default :func:`compute_threads` of one
    process) and ``MALLOC_ENV``.
    """
    if intra_op is None:
        intra_op = compute_threads(1)
    with _Children() as children:
        child = children.start(
            "keras-local",
            _tf_child_argv(
                "local", hidden=list(hidden), batch=batch, repeats=repeats, seconds=seconds,
                warmup_steps=_LOCAL_WARMUP_STEPS, intra_op=intra_op, inter_op=inter_op,
            ),
            intra_op, inter_op,
        )
        result = json.loads(
            child.read_tagged_line("RESULT", _STARTUP_TIMEOUT_S + 3 * repeats * seconds)
        )
    return Samples(f"keras local loop {_model_name(hidden)}", "steps/s", result["values"])


def tf_ps_strategy(
    hidden: tuple[int, ...],
    batch: int = 64,
    num_ps: int = 2,
    num_workers: int = 2,
    repeats: int = 3,
    seconds: float = 5.0,
    *,
    intra_op: int | None = None,
    worker_inter_op: int | None = None,
) -> Samples:
    """Measure TensorFlow's ``ParameterServerStrategy`` in aggregate steps/s.

    Starts ``num_ps`` PS and ``num_workers`` worker ``tf.distribute.Server`` processes on
    free 127.0.0.1 ports plus a coordinator process that builds the same model as
    :func:`keras_local_loop` under ``tf.distribute.ParameterServerStrategy`` (TF's default
    placement: whole variables round-robin over the PS tasks, i.e. all kernels on ``ps:0``;
    Keras 3 cannot train ``ShardedVariable``s) and schedules one-batch training steps on the workers through
    ``tf.distribute.coordinator.ClusterCoordinator``, with at most a few steps in flight per
    worker. Input batches are generated on the workers. Each of the ``repeats`` repetitions
    schedules steps for ``seconds``, waits for all of them to finish and reports steps done by
    all workers per second. Workers get ``intra_op`` threads (default: :func:`compute_threads`
    of ``num_workers``) and ``worker_inter_op`` inter-op threads, by default ``num_workers + 1``
    (``inter_op=1`` hangs); PS tasks and the coordinator 1 intra-op thread and TF's default
    inter-op pool. All processes are killed on return, on error and on timeout.
    """
    if intra_op is None:
        intra_op = compute_threads(num_workers)
    if worker_inter_op is None:
        worker_inter_op = num_workers + 1
    ports = _free_ports(num_ps + num_workers)
    cluster = {
        "ps": [f"127.0.0.1:{port}" for port in ports[:num_ps]],
        "worker": [f"127.0.0.1:{port}" for port in ports[num_ps:]],
    }
    tasks = [("ps", i) for i in range(num_ps)] + [("worker", i) for i in range(num_workers)]
    threads = {"ps": (1, 0), "worker": (intra_op, worker_inter_op), "coordinator": (1, 0)}
    with _Children() as children:
        servers = [
            children.start(
                f"tf-{job}-{index}",
                _tf_child_argv(
                    "server", cluster=cluster, job_name=job, task_index=index,
                    intra_op=threads[job][0], inter_op=threads[job][1], parent_pid=os.getpid(),
                ),
                *threads[job],
            )
            for job, index in tasks
        ]
        for server in servers:
            server.read_tagged_line("READY", _STARTUP_TIMEOUT_S)
        coordinator = children.start(
            "tf-coordinator",
            _tf_child_argv(
                "coordinator", cluster=cluster, hidden=list(hidden), batch=batch,
                repeats=repeats, seconds=seconds, warmup_steps=_PS_WARMUP_STEPS,
                intra_op=threads["coordinator"][0], inter_op=threads["coordinator"][1],
            ),
            *threads["coordinator"],
        )
        result = json.loads(
            coordinator.read_tagged_line("RESULT", _STARTUP_TIMEOUT_S + 4 * repeats * seconds)
        )
    return Samples(
        f"TF ParameterServerStrategy {num_ps}ps+{num_workers}w {_model_name(hidden)}",
        "steps/s",
        result["values"],
    )


def raw_grpc_streaming(
    megabytes: int = 40, chunk_bytes: int = 1 << 20, repeats: int = 5
) -> tuple[Samples, Samples]:
    """Measure raw gRPC streaming throughput; return ``(download MB/s, upload MB/s)``.

    A generic-handler gRPC server with identity (bytes) serializers runs in a separate
    process on 127.0.0.1 (see ``benchmarks/_grpc_child.py``). The client, in this process,
    downloads ``megabytes`` MB via server streaming and uploads the same amount via client
    streaming, in ``chunk_bytes`` messages, ``repeats`` times each after one warm-up round.
    Chunks are pre-built on both sides and the receiver only counts bytes, so this is the
    transport ceiling, without serialization or copying into tensors.
    """
    total = megabytes * MB
    rpc_timeout = 120.0
    with _Children() as children:
        server = children.start(
            "grpc-server", [sys.executable, str(_GRPC_CHILD), str(os.getpid())], 1, 1
        )
        port = int(server.read_tagged_line("PORT", _STARTUP_TIMEOUT_S))
        with grpc.insecure_channel(
            f"127.0.0.1:{port}", options=_grpc_child.GRPC_OPTIONS
        ) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            # No (de)serializers: messages are raw bytes on both ends.
            download_rpc = channel.unary_stream(_grpc_child.DOWNLOAD, None, None)
            upload_rpc = channel.stream_unary(_grpc_child.UPLOAD, None, None)
            request = struct.pack("<QQ", total, chunk_bytes)

            def download() -> float:
                start = time.perf_counter()
                received = sum(len(message) for message in download_rpc(request, timeout=rpc_timeout))
                elapsed = time.perf_counter() - start
                if received != total:
                    raise BaselineError(f"downloaded {received} bytes, expected {total}")
                return total / MB / elapsed

            def upload() -> float:
                start = time.perf_counter()
                reply = upload_rpc(
                    _grpc_child.iter_chunks(total, chunk_bytes), timeout=rpc_timeout
                )
                elapsed = time.perf_counter() - start
                (received,) = struct.unpack("<Q", reply)
                if received != total:
                    raise BaselineError(f"uploaded {received} bytes, expected {total}")
                return total / MB / elapsed

            download()
            upload()
            down = [download() for _ in range(repeats)]
            up = [upload() for _ in range(repeats)]
    label = f"{megabytes} MB in {chunk_bytes}-byte chunks"
    return (
        Samples(f"raw gRPC download {label}", "MB/s", down),
        Samples(f"raw gRPC upload {label}", "MB/s", up),
    )


def raw_tcp(megabytes: int = 40, repeats: int = 5) -> tuple[Samples, Samples]:
    """Measure a plain TCP socket moving the same bytes; return ``(download MB/s, upload MB/s)``.

    The server (``benchmarks/_tcp_child.py``, its own process on 127.0.0.1) sends from and
    receives into one preallocated buffer; the client here does the same (``sendall`` of a
    memoryview, ``recv_into``). One request of a few bytes starts each transfer and an 8-byte
    count ends an upload: the floor any TCP data path can reach on this machine.
    """
    from benchmarks import _tcp_child

    total = megabytes * MB
    if total > 64 << 20:
        raise BaselineError(f"raw TCP moves at most 64 MiB, not {megabytes} MB")
    buffer = memoryview(bytearray(total))
    with _Children() as children:
        server = children.start("tcp-server", [sys.executable, str(_TCP_CHILD), str(os.getpid())], 1, 1)
        port = int(server.read_tagged_line("PORT", _STARTUP_TIMEOUT_S))
        with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ack = memoryview(bytearray(8))

            def download() -> float:
                start = time.perf_counter()
                sock.sendall(_tcp_child.REQUEST.pack(_tcp_child.DOWNLOAD, total))
                received = _tcp_child.recv_exactly(sock, buffer)
                elapsed = time.perf_counter() - start
                if received != total:
                    raise BaselineError(f"downloaded {received} bytes, expected {total}")
                return total / MB / elapsed

            def upload() -> float:
                start = time.perf_counter()
                sock.sendall(_tcp_child.REQUEST.pack(_tcp_child.UPLOAD, total))
                sock.sendall(buffer)
                _tcp_child.recv_exactly(sock, ack)
                elapsed = time.perf_counter() - start
                (received,) = struct.unpack("<Q", ack)
                if received != total:
                    raise BaselineError(f"uploaded {received} bytes, expected {total}")
                return total / MB / elapsed

            download()
            upload()
            down = [download() for _ in range(repeats)]
            up = [upload() for _ in range(repeats)]
    return (Samples(f"raw TCP download {megabytes} MB", "MB/s", down),
            Samples(f"raw TCP upload {megabytes} MB", "MB/s", up))


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.baselines",
        description="Run the asyncps comparison baselines and print median and min-max.",
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="also write all samples as JSON to PATH"
    )
    parser.add_argument(
        "--no-reexec", action="store_true",
        help="do not re-execute with the tuned MALLOC_* environment first",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run all baselines for hidden (512, 512) and (2048, 2048) and print the results."""
    args = _parse_args(argv)
    if not args.no_reexec:
        reexec_with_tuned_malloc()
    cpus = os.cpu_count()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# asyncps baselines: {cpus} CPUs, load average {load}, "
          f"malloc tuned: {malloc_is_tuned()}", flush=True)
    started = time.perf_counter()
    results: list[Samples] = []
    failures = 0

    def run(label: str, measure: Callable[[], Samples | tuple[Samples, ...]]) -> None:
        nonlocal failures
        try:
            measured = measure()
        except BaselineError as exc:  # report and go on with the other baselines
            failures += 1
            print(f"{label}: FAILED: {exc}", flush=True)
            return
        for samples in measured if isinstance(measured, tuple) else (measured,):
            results.append(samples)
            print(samples.summary(), flush=True)

    for hidden in ((512, 512), (2048, 2048)):
        run(f"keras local loop {hidden}", functools.partial(keras_local_loop, hidden))
        run(f"TF ParameterServerStrategy {hidden}", functools.partial(tf_ps_strategy, hidden))
    run("raw gRPC streaming", raw_grpc_streaming)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# done in {time.perf_counter() - started:.0f} s, load average {load}")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(s) for s in results], indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
