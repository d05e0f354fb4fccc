"""A table larger than a worker's memory budget trains: `python -m benchmarks.bigtable`.

`asyncps local` with the recsys model over a table of `--rows` x `--dim` float32 (default 32M x 32: 4.1 GB, and
as much again for Adagrad's accumulator), on 2 shards with 2 workers, for a fixed number of updates. Only the
shards hold the table: they make their parts from its row initializer (the chief sends no values), the
workers and the chief's evaluation read the rows their batches look up. Prints each process' peak RSS
(VmHWM, sampled by the benchmark's cluster runner) and whether the workers (and the chief) stayed under the
budget. Not part of the test suites: it needs the shards' memory (table and slot, about 8.2 GB by default).

`--kill-shard S`: checkpoints every S seconds, ps-0 SIGKILLed once the first one is written, restarted, and
restored by the chief from that checkpoint (its part streamed from the checkpoint's files); prints the
restore's time from the chief's log beside the peaks (the chief's peak then covers a checkpoint written
and a restore read).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from asyncps.config import RunConfig
from asyncps.rundir import RunDir
from asyncps.tools.local import LocalCluster
from asyncps.tools.memwatch import MemoryWatch
from benchmarks.asyncps_runs import run_cluster_summary

#: What a worker (and the chief) may use, MB: far less than the table.
BUDGET_MB = 1024.0


def bigtable_run(rows: int, dim: int, updates: int, transport: str, checkpoint: bool) -> RunConfig:
    """The run: recsys data and model over `rows` ids, 2 shards, 2 workers, Adagrad, `updates` updates,
    evaluations only at the end; with `checkpoint`, one checkpoint at the end (streamed by the chief into
    its files; each shard copies its state for it), else none."""
    return RunConfig(dataset=f"recsys:rows={rows}", model=f"recsys:rows={rows},dim={dim}", num_workers=2,
                     num_ps=2, optimizer="adagrad", learning_rate=0.05, batch_size=256, max_updates=updates,
                     epochs=1000.0, eval_every_s=100000.0, transport=transport, rpc_deadline_s=600.0,
                     checkpoint_every_s=100000.0 if checkpoint else 0.0)


def killed_shard_run(run: RunConfig) -> tuple[dict[str, float], list[str]]:
    """`run` on a local cluster, ps-0 SIGKILLed once the first checkpoint is written and restarted (the
    chief restores it); each process' peak RSS (MB) and the chief's log lines of the recovery."""
    with tempfile.TemporaryDirectory(prefix="asyncps-bigtable-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        cluster = LocalCluster(run, run_dir, fork=False)  # exec'd, as benchmarks/asyncps_runs.py says why
        watch = MemoryWatch()
        killed = False
        try:
            cluster.start()
            while cluster.chief.alive():
                watch.sample((c.name, c.proc.pid) for c in cluster.children)
                if not killed and any(RunDir(run_dir).checkpoints.glob("ckpt-*[0-9]")):
                    os.kill(next(c for c in cluster.children if c.name == "ps-0").proc.pid, signal.SIGKILL)
                    killed = True
                cluster.restart_dead_shards()
                time.sleep(0.25)
        finally:
            cluster.stop()
        log = RunDir(run_dir).log("chief").read_text(errors="replace")
        if cluster.exit_codes().get("chief") != 0:
            raise RuntimeError(f"the chief failed:\n{log[-2000:]}")
        lines = [line for line in log.splitlines() if re.search(r"recovering|restored from|checkpoint ckpt-", line)]
        return watch.peaks, lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run once; print the figures (exit 1 when a worker went over the budget)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--checkpoint", action="store_true", help="one checkpoint at the end (8.2 GB written)")
    parser.add_argument("--kill-shard", type=float, default=0.0, metavar="S",
                        help="checkpoints every S s, ps-0 killed after the first and restored from it")
    args = parser.parse_args(argv)
    if args.kill_shard:
        return kill_shard_main(args)
    table_mb = args.rows * args.dim * 4 / 2**20
    print(f"table {args.rows} x {args.dim} float32: {table_mb:.0f} MB (+ as much for Adagrad's accumulator); "
          f"2 shards, 2 workers, {args.updates} updates, transport {args.transport}, "
          f"{'a checkpoint at the end' if args.checkpoint else 'no checkpoint'}")
    started = time.monotonic()
    run = bigtable_run(args.rows, args.dim, args.updates, args.transport, args.checkpoint)
    done = run_cluster_summary(run, skip_s=0.0)
    took = time.monotonic() - started
    summary = done.summary
    print(f"{summary.updates_applied} updates in {took:.0f}s (training {summary.wall_s:.0f}s, "
          f"{summary.throughput_updates_per_s:.0f} updates/s); final eval loss {summary.final_eval.loss:.4f} "
          f"accuracy {summary.final_eval.accuracy:.4f}")
    _print_peaks(done.peaks)
    workers = {n: mb for n, mb in done.peaks.items() if n.startswith("worker")}
    over = {n: mb for n, mb in workers.items() if mb >= BUDGET_MB}
    chief = done.peaks.get("chief", 0.0)
    print(f"workers under {BUDGET_MB:.0f} MB: {'yes' if not over else f'no {over}'}; chief under {BUDGET_MB:.0f} MB: "
          f"{'yes' if chief < BUDGET_MB else 'no'} ({chief:.0f} MB)")
    return 1 if over else 0


def kill_shard_main(args: argparse.Namespace) -> int:
    """--kill-shard: run, kill ps-0 after the first checkpoint, print the recovery and the peaks."""
    run = bigtable_run(args.rows, args.dim, args.updates, args.transport, True)
    run = RunConfig(**{**run.__dict__, "checkpoint_every_s": args.kill_shard})
    print(f"table {args.rows} x {args.dim} float32: {args.rows * args.dim * 4 / 2**20:.0f} MB; 2 shards, 2 workers, "
          f"{args.updates} updates, checkpoints every {args.kill_shard:g}s, ps-0 killed after the first")
    peaks, lines = killed_shard_run(run)
    for line in lines:
        print("  chief:", line)
    _print_peaks(peaks)
    return 0


def _print_peaks(peaks: dict[str, float]) -> None:
    print("| process | peak RSS, MB |")
    print("|---|---|")
    for name, mb in sorted(peaks.items()):
        print(f"| {name} | {mb:.0f} |")


if __name__ == "__main__":
    raise SystemExit(main())
