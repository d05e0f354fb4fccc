"""`python -m asyncps`: the `asyncps` command (asyncps.tools.cli)."""

from __future__ import annotations

import sys

from asyncps.tools.cli import main

sys.exit(main())
