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

    from asyncps.pb import coordinator_pb2 as cpb
    from asyncps.security import SecurityConfig


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
            f"loss {_fmt(s.worker_loss, '.4f')}  eval acc {_fmt(s.eval_accuracy, '.4f')} @ {s.eval_version}  "
            f"staleness {s.mean_staleness:5.2f}  workers {s.workers_alive}/{s.workers_planned}")


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
        from asyncps.coordclient import CoordinatorClient

        self._client = CoordinatorClient(address, deadline_s=timeout_s, security=security,
                                         call_timeout_s=timeout_s)
        self._timeout_s = timeout_s

    def poll(self) -> cpb.ClusterStatus:
        """The status now (raises asyncps.rpc.Unreachable or grpc.RpcError when the chief does not answer)."""
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
