"""The target's features as they travel from the verifier to a feature-level drafter (EAGLE).

``TargetFeatures(start, values)``: row i of ``values`` [n, H] is the target's final-norm input (its
last decoder layer's output) at position ``start + i``. Invariant: a feature at position s is computed
from the committed tokens x_0..x_s only, so it never changes once sent; a verdict carries exactly the
positions whose tokens it committed and whose features no earlier verdict carried.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WIRE_DTYPE = torch.float16  # what travels (TargetFeatures.data): 2 bytes per value


@dataclass(frozen=True)
class TargetFeatures:
    start: int
    values: torch.Tensor  # [n, H]

    def __len__(self) -> int:
        return int(self.values.shape[0])

    @property
    def end(self) -> int:
        return self.start + len(self)

    @property
    def wire_bytes(self) -> int:
        return self.values.numel() * WIRE_DTYPE.itemsize

    def then(self, later: TargetFeatures | None) -> TargetFeatures:
        """These features followed by ``later`` (which may overlap them: its rows win); ``ValueError``
        if a gap would separate them."""
        if later is None or len(later) == 0:
            return self
        if len(self) == 0:
            return later
        if later.start > self.end or later.start < self.start:
            raise ValueError(f"target features: positions {later.start}.. cannot follow {self.start}..{self.end - 1}")
        if later.values.shape[1] != self.values.shape[1]:
            raise ValueError(f"target features: width {later.values.shape[1]} after width {self.values.shape[1]}")
        keep = self.values[: later.start - self.start].to(later.values.dtype)
        return TargetFeatures(self.start, torch.cat([keep, later.values]))


def join(parts: list[TargetFeatures]) -> TargetFeatures | None:
    """Consecutive features as one (None for none)."""
    joined = None
    for part in parts:
        joined = part if joined is None else joined.then(part)
    return joined
