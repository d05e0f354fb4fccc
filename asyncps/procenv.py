"""The environment of every process asyncps starts: one allocator setting, one thread rule.

Every launcher uses this module: `asyncps local` (asyncps.tools.local), the test fixtures that
start real processes (tests/conftest.py) and every contender of the benchmarks (benchmarks/:
the Keras loop, TF's ParameterServerStrategy, the raw gRPC server and asyncps itself). The
Dockerfile's ENV block and docker-compose.yml carry the same values; tests/test_procenv.py checks
that they match these constants.

glibc reads its MALLOC_* tunables only at process start, so they have to be in a process's
environment when it is exec'd (a running process cannot adopt them).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Mapping

_MIB = 1 << 20

#: glibc malloc tunables (values in bytes). Measured on the project's machine: tobytes() of a
#: 40 MB array 24 ms -> 3.4 ms, unary gRPC of 40 MB 230 MB/s -> ~1 GB/s.
MALLOC_ENV: dict[str, str] = {
    # Serve buffers up to 256 MiB (whole tensors, gRPC messages, 40 MB models) from the heap,
    # not a fresh mmap per allocation that page-faults on every first touch and munmaps on free.
    "MALLOC_MMAP_THRESHOLD_": str(256 * _MIB),
    # Keep up to 512 MiB of freed memory at the heap top instead of giving it back after each
    # free; above the mmap threshold, so freeing one largest buffer never trims by itself.
    "MALLOC_TRIM_THRESHOLD_": str(512 * _MIB),
    # Grow the heap 64 MiB beyond each request, so a run of large buffers costs a few brk calls.
    "MALLOC_TOP_PAD_": str(64 * _MIB),
}

#: Environment variables that cap a process's native thread pools, all set by `thread_env`.
THREAD_VARS: tuple[str, ...] = (
    "TF_NUM_INTRAOP_THREADS",  # TensorFlow's per-op pool (also set through tf.config by the roles)
    "TF_NUM_INTEROP_THREADS",  # TensorFlow's op-scheduling pool
    "OMP_NUM_THREADS",  # OpenMP (oneDNN builds, some numpy BLAS)
    "OPENBLAS_NUM_THREADS",  # numpy's OpenBLAS
)


#: How a child runs the asyncps CLI. `python -m asyncps.tools.cli` would put the working directory first on the
#: child's sys.path, so started from a checkout's root it would import the checkout's asyncps/ folder (the core,
#: without the role folders that install as asyncps.ps, .worker and .chief) in place of the installed package.
#: `-c` puts '' there instead, and the bootstrap takes it off before the first asyncps import (Python 3.11's `-P`
#: does the same; 3.10 lacks it). User code reaches children through --user-path / ASYNCPS_USER_PATH, not the cwd.
CLI_BOOTSTRAP = "import sys; del sys.path[0]; from asyncps.tools.cli import main; sys.exit(main())"


def cli_command(*args: str) -> list[str]:
    """The argv that runs `asyncps ARGS` in a child process of this interpreter, the working directory off its path."""
    return [sys.executable, "-c", CLI_BOOTSTRAP, *args]


def freeze_heap() -> None:
    """Collect once, then move every object alive now (TensorFlow's modules, the model, the data, the
    traced functions) out of the garbage collector's sight, so a collection walks only what the run
    allocates since. A role calls it once, when it is set up and before its steady loop: a worker
    without it spent a third of its samples in gc_collect_main (py-spy --native, the big MLP over
    shared memory), every full collection walking TensorFlow's millions of objects again."""
    gc.collect()
    gc.freeze()


def thread_env(intra_op: int, inter_op: int | None = None) -> dict[str, str]:
    """The THREAD_VARS for a process whose TensorFlow runs `intra_op`/`inter_op` threads.

    `inter_op` defaults to `intra_op` (asyncps' --tf-threads sets both). 0 for either means the
    library default: that variable is left out. OpenMP and OpenBLAS follow `intra_op`, the pool
    that does the arithmetic.
    """
    inter_op = intra_op if inter_op is None else inter_op
    if intra_op < 0 or inter_op < 0:
        raise ValueError(f"thread counts must be >= 0, got intra_op={intra_op} inter_op={inter_op}")
    env: dict[str, str] = {}
    if intra_op > 0:
        env.update(TF_NUM_INTRAOP_THREADS=str(intra_op), OMP_NUM_THREADS=str(intra_op),
                   OPENBLAS_NUM_THREADS=str(intra_op))
    if inter_op > 0:
        env["TF_NUM_INTEROP_THREADS"] = str(inter_op)
    return env


def process_env(base: Mapping[str, str] | None = None, *, intra_op: int = 0,
                inter_op: int | None = None) -> dict[str, str]:
    """`base` (default: os.environ) plus MALLOC_ENV, thread_env and quiet, unbuffered Python/TF.

    Thread variables inherited from `base` are dropped first, so a child gets exactly the pool
    sizes asked for (or the libraries' defaults for 0), whatever the launcher's shell had.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in THREAD_VARS}
    env.update(MALLOC_ENV)
    env.update(thread_env(intra_op, inter_op))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def has_malloc_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `environ` (default: os.environ) carries MALLOC_ENV exactly."""
    env = os.environ if environ is None else environ
    return all(env.get(key) == value for key, value in MALLOC_ENV.items())


__all__ = ["CLI_BOOTSTRAP", "MALLOC_ENV", "THREAD_VARS", "cli_command", "has_malloc_env", "process_env", "thread_env"]
