"""Why a push is dropped: one enum from the rules that decide it to pushes.csv."""

from __future__ import annotations

import enum


class DropReason(enum.Enum):
    """Why a shard dropped a push; the value is what pushes.csv and the reports show.

    The same kinds travel on the wire (ps.proto DropReason) and to the chief, so nothing
    downstream parses a message to learn the kind.
    """

    STALE = "stale"  # the staleness policy refused it (drop:K)
    LATE = "late"  # sync: its version was already applied without it (a backup worker's step)
    DUPLICATE = "duplicate"  # sync: this worker already contributed to the pending version
    RESTORED = "restored"  # computed from a previous incarnation of the shard (a restore happened)
    # a non-finite loss or gradient (NaN/Inf): the worker skips the step before pushing it, and a
    # shard that still receives one refuses it (INVALID_ARGUMENT, typed errors.NonFiniteGradientError)
    NONFINITE = "nonfinite"


__all__ = ["DropReason"]
