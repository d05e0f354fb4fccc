"""Steps of a coordinated mode: the gradients one step averages, and how many steps are remembered."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from asyncps.wire.codec import Array, Gradient, SparseRows

# How many decided steps a coordinator remembers: a worker up to this many steps behind still
# carries every decision its follower shards lack.
DECISION_LOG = 4096


@dataclass
class PendingStep:
    """Gradients accumulated for one step (sums of dense, lists of sparse)."""

    count: int = 0
    dense: dict[str, Array] = field(default_factory=dict)
    sparse: dict[str, list[SparseRows]] = field(default_factory=dict)

    def add(self, grads: Mapping[str, Gradient]) -> None:
        """Add one worker's gradient."""
        self.count += 1
        for name, grad in grads.items():
            if isinstance(grad, SparseRows):
                # copied: a transport may hand over views of a buffer it reuses (shared memory)
                self.sparse.setdefault(name, []).append(SparseRows(np.array(grad.indices, copy=True),
                                                                   np.array(grad.values, copy=True)))
            elif name in self.dense:
                self.dense[name] += grad
            else:
                self.dense[name] = np.array(grad, copy=True)

    def average(self) -> dict[str, Gradient]:
        """The mean gradient over the accumulated workers."""
        out: dict[str, Gradient] = {name: total / np.float32(self.count) for name, total in self.dense.items()}
        for name, parts in self.sparse.items():
            values = np.concatenate([p.values for p in parts]) / np.float32(self.count)
            out[name] = SparseRows(np.concatenate([p.indices for p in parts]), values.astype(parts[0].values.dtype))
        return out


__all__ = ["DECISION_LOG", "PendingStep"]
