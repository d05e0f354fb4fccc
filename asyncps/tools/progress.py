"""Live progress of a run from the chief's GetStatus: a rich progress bar with percent and ETA on a
terminal, one line every few seconds on a pipe or a log. Used by `asyncps local`, `asyncps status`
and the sweeps (`asyncps experiment`), so a run looks the same wherever it is watched from."""

from __future__ import annotations

import math
import sys
import time
from typing import IO, TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from asyncps.net.security import SecurityConfig
    from asyncps.pb import coordinator_pb2 as cpb


def _fmt(x: float, spec: str) -> str:
    return "-" if math.isnan(x) else format(x, spec)


def eta_s(elapsed_s: float, fraction: float) -> float:
    """Seconds left at the rate so far; NaN when the share done is unknown (< 0) or still 0."""
    if fraction >= 1.0:
        return 0.0
    if fraction <= 0.0 or elapsed_s <= 0.0:
        return math.nan
    return elapsed_s * (1.0 - fraction) / fraction


def format_duration(seconds: float) -> str:
    """E.g. `42s`, `3m05s`, `1h02m`; `-` when unknown."""
    if math.isnan(seconds) or seconds < 0:
        return "-"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def percent_text(fraction: float) -> str:
    """E.g. ` 42.0%`; `    -` for a run with no stop condition."""
    return f"{100 * fraction:5.1f}%" if fraction >= 0 else "    -"


def stats_text(s: cpb.ClusterStatus) -> str:
    """The run's numbers: updates and their rate, epochs, losses, accuracy, staleness, workers."""
    return (f"updates {s.updates:6d} ({s.updates_per_s:6.1f}/s)  epoch {s.epochs:5.2f}  "
            f"loss {_fmt(s.worker_loss, '.4f')}  {eval_text(s)} @ {s.eval_version}  "
            f"staleness {s.mean_staleness:5.2f}  workers {s.workers_alive}/{s.workers_planned}")


def eval_text(s: cpb.ClusterStatus) -> str:
    """The latest evaluation: its accuracy for a classification run, else its loss (and the task's metrics)."""
    if math.isnan(s.eval_accuracy) and not math.isnan(s.eval_loss):
        return f"eval loss {_fmt(s.eval_loss, '.4g')}" + "".join(f" {k} {v:.4g}" for k, v in
                                                              sorted(s.eval_metrics.items()))
    return f"eval acc {_fmt(s.eval_accuracy, '.4f')}"


def status_line(s: cpb.ClusterStatus) -> str:
    """One line: elapsed time, percent done, ETA and the run's numbers (stop reason once stopping)."""
    eta = eta_s(s.elapsed_s, s.fraction_done)
    line = f"[{s.elapsed_s:6.1f}s] {percent_text(s.fraction_done)} ETA {format_duration(eta):>6}  {stats_text(s)}"
    if s.done:
        line += "  (done)"
    elif s.stop_reason:
        line += f"  (stopping: {s.stop_reason})"
    return line


class StatusSink(Protocol):
    """Something that shows a run's status as it changes."""

    def show(self, status: cpb.ClusterStatus) -> None:
        """Show the latest status."""

    def close(self) -> None:
        """The run is over (or no longer watched)."""


class LineDisplay:
    """One status line at most every `every_s` seconds (the first at once): for pipes and logs."""

    def __init__(self, stream: IO[str] = sys.stdout, every_s: float = 2.0, prefix: str = "") -> None:
        self._stream = stream
        self._every_s = every_s
        self._prefix = prefix
        self._last: float | None = None

    def show(self, status: cpb.ClusterStatus) -> None:
        """Print the status unless one was printed less than every_s ago."""
        now = time.monotonic()
        if self._last is not None and now - self._last < self._every_s:
            return
        self._last = now
        self._stream.write(self._prefix + status_line(status) + "\n")
        self._stream.flush()

    def close(self) -> None:
        """Nothing to end: every line is complete."""


class EvalLineDisplay:
    """One status line per new evaluation (Keras' verbose=2: a line per epoch); the run's end says the rest."""

    def __init__(self, stream: IO[str] = sys.stdout) -> None:
        self._stream = stream
        self._seen = -1  # the eval_version last printed

    def show(self, status: cpb.ClusterStatus) -> None:
        """Print the status when it carries an evaluation not printed yet."""
        if status.eval_version != self._seen and status.eval_version > 0:
            self._seen = status.eval_version
            self._stream.write(status_line(status) + "\n")
            self._stream.flush()

    def close(self) -> None:
        """Nothing to end: every line is complete."""


def _bar(stream: IO[str]) -> Progress:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

    return Progress(TextColumn("{task.description}"), BarColumn(bar_width=30), TaskProgressColumn(),
                    TextColumn("ETA {task.fields[eta]:>6}"), TextColumn("{task.fields[info]}"),
                    console=Console(file=stream), refresh_per_second=4)


class BarDisplay:
    """A rich progress bar with percent and ETA (and the run's numbers beside it): for terminals."""

    def __init__(self, stream: IO[str] = sys.stdout, label: str = "run") -> None:
        self._progress = _bar(stream)
        self._task: TaskID = self._progress.add_task(label, total=100.0, eta="-", info="waiting for the chief")
        self._progress.start()

    def show(self, status: cpb.ClusterStatus) -> None:
        """Move the bar (a pulsing one while the run has no stop condition)."""
        show_task(self._progress, self._task, status)

    def close(self) -> None:
        """Leave the final bar on the screen."""
        self._progress.stop()


def show_task(progress: Progress, task: TaskID, status: cpb.ClusterStatus) -> None:
    """Set a rich task to a run's status: percent, ETA, numbers."""
    fraction = status.fraction_done
    eta = format_duration(eta_s(status.elapsed_s, fraction))
    if fraction < 0:
        progress.update(task, total=None, eta=eta, info=stats_text(status))
    else:
        progress.update(task, total=100.0, completed=100.0 * fraction, eta=eta, info=stats_text(status))


def display_for(stream: IO[str] = sys.stdout, label: str = "run", every_s: float = 2.0) -> StatusSink:
    """A bar on a terminal, lines (at most every `every_s` seconds) elsewhere."""
    return BarDisplay(stream, label) if stream.isatty() else LineDisplay(stream, every_s)


class StatusPoller:
    """Reads the chief's status: a client of its Coordinator service with short deadlines."""

    def __init__(self, address: str, security: SecurityConfig | None = None, timeout_s: float = 2.0) -> None:
        from asyncps.transport.coordinator import CoordinatorClient

        self._client = CoordinatorClient(address, deadline_s=timeout_s, security=security,
                                         call_timeout_s=timeout_s)
        self._timeout_s = timeout_s

    def poll(self) -> cpb.ClusterStatus:
        """The status now (raises asyncps.errors: Unreachable when the chief does not answer)."""
        return self._client.status(deadline_s=self._timeout_s)

    def try_poll(self) -> cpb.ClusterStatus | None:
        """The status, or None while the chief is starting or finishing."""
        try:
            return self.poll()
        except Exception:  # the next poll will tell: a launcher's display must never end a run
            return None

    def close(self) -> None:
        """Close the channel."""
        self._client.close()


def watch(address: str, security: SecurityConfig | None, follow: bool, interval_s: float = 2.0,
          count: int = 0, stream: IO[str] = sys.stdout, timeout_s: float = 5.0) -> int:
    """`asyncps status`: print the status once, or (`follow`) keep showing it until the run is done,
    the chief goes away or `count` polls were shown. Exit status 0, or 1 when the chief never answered."""
    poller = StatusPoller(address, security, timeout_s)
    sink: StatusSink = display_for(stream, address, every_s=0.0) if follow else LineDisplay(stream, every_s=0.0)
    shown = 0
    try:
        while True:
            try:
                status = poller.poll()
            except Exception as exc:
                if shown == 0:
                    print(f"asyncps status: the chief at {address} did not answer: {exc}", file=sys.stderr)
                    return 1
                break  # the chief ended the run and exited
            sink.show(status)
            shown += 1
            if not follow or status.done or (count and shown >= count):
                break
            time.sleep(interval_s)
        return 0
    finally:
        sink.close()
        poller.close()


class SweepProgress:
    """A sweep's progress: a bar over its points (percent and ETA of the whole sweep, counting the
    running point's share) and the running point's own bar; on a pipe, a prefixed status line of the
    running point every `every_s` seconds. Points already finished (resumed) take no time in the ETA."""

    def __init__(self, to_run: int, total: int, stream: IO[str] = sys.stdout, every_s: float = 10.0) -> None:
        self._stream = stream
        self._to_run = max(1, to_run)
        self._total = total
        self._every_s = every_s
        self._ran = 0  # points run (not resumed) so far
        self._run_s = 0.0  # seconds spent running them
        self._point_started: float | None = None
        self._progress: Progress | None = None
        if stream.isatty():
            self._progress = _bar(stream)
            self._sweep = self._progress.add_task(f"sweep 0/{total}", total=100.0, eta="-", info="")
            self._point = self._progress.add_task("point", total=100.0, eta="-", info="")
            self._progress.start()

    def share_done(self, point_fraction: float) -> float:
        """The sweep's share done: points run, plus the running point's share, over the points to run."""
        return min(1.0, (self._ran + max(0.0, point_fraction)) / self._to_run)

    def point(self, n: int, label: str) -> StatusSink:
        """The sink of point n's status while it runs."""
        self._point_started = time.monotonic()
        if self._progress is None:
            return LineDisplay(self._stream, self._every_s, prefix=f"[{n}/{self._total}] {label}: ")
        self._progress.update(self._point, description=f"[{n}/{self._total}] {label}", completed=0.0, total=100.0,
                              eta="-", info="starting")
        return _SweepPointSink(self, self._progress, self._point)

    def show_sweep(self, point_fraction: float) -> None:
        """Move the sweep's bar to the running point's share."""
        if self._progress is None or self._point_started is None:
            return
        share = self.share_done(point_fraction)
        elapsed = self._run_s + time.monotonic() - self._point_started
        self._progress.update(self._sweep, completed=100.0 * share, eta=format_duration(eta_s(elapsed, share)))

    def point_done(self, n: int, line: str, ran: bool) -> None:
        """A point ended (`ran`: it was run now, not resumed); print its line above the bars."""
        if ran and self._point_started is not None:
            self._ran += 1
            self._run_s += time.monotonic() - self._point_started
        self._point_started = None
        if self._progress is None:
            self._stream.write(line + "\n")
            self._stream.flush()
            return
        self._progress.console.print(line, markup=False, highlight=False)
        share = self.share_done(0.0)
        self._progress.update(self._sweep, description=f"sweep {n}/{self._total}", completed=100.0 * share,
                              eta=format_duration(eta_s(self._run_s, share)))

    def close(self) -> None:
        """Leave the final bars on the screen."""
        if self._progress is not None:
            self._progress.stop()


class _SweepPointSink:
    """The running point's status, to its bar and to the sweep's."""

    def __init__(self, sweep: SweepProgress, progress: Progress, task: TaskID) -> None:
        self._sweep, self._progress, self._task = sweep, progress, task

    def show(self, status: cpb.ClusterStatus) -> None:
        show_task(self._progress, self._task, status)
        self._sweep.show_sweep(status.fraction_done)

    def close(self) -> None:
        """The point's bar is reused by the next point."""
