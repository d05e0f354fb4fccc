"""The fork server's process (asyncps.tools.forkserver): serve, and in each forked child run the asyncps CLI.

Apart from asyncps.tools.forkserver, which the CLI's launcher imports, so that no import circle runs through the CLI.
"""

from __future__ import annotations

from asyncps.tools.cli import main as cli_main
from asyncps.tools.forkserver import serve


def main() -> int:
    """Serve until the launcher closes the pipe (0); in a forked child, run the CLI with that child's arguments."""
    args = serve()
    return 0 if args is None else cli_main(args)
