"""The target's features as they travel from the verifier to a feature-level drafter (EAGLE).

``TargetFeatures(start, values)``: row i of ``values`` [n, H] is the target's final-norm input (its
last decoder layer's output) at position ``start + i``. Invariant: a feature at position s is computed
from the committed tokens x_0..x_s only, so it never changes once sent; a verdict carries exactly the
positions whose tokens it committed and whose features no earlier verdict carried.

On the wire they are ``WIRE_DTYPE`` (``EncodedFeatures``): bfloat16, float32's exponent range at 2
bytes a value, so no target's features overflow it (a bf16 target's residual stream can hold values
past float16's 65504, which float16 would send as inf); a bf16 target's features travel unchanged.
The gateway relays them as received, never decoding them (``FeatureRelay``); the drafter decodes and
validates them (``EncodedFeatures.decode``), so a malformed payload fails that request's drafting only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

WIRE_DTYPE = torch.bfloat16  # what travels (the proto's TargetFeatures.bf16_data): 2 bytes per value
_WIRE_BITS = np.dtype("<u2")  # the same 2 bytes as numpy sees them (numpy has no bfloat16): little-endian


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

    def encode(self) -> EncodedFeatures:
        bits = self.values.detach().to("cpu", WIRE_DTYPE).contiguous().view(torch.int16).numpy().view(np.uint16)
        return EncodedFeatures(self.start, len(self), int(self.values.shape[1]), bits.astype(_WIRE_BITS).tobytes())


@dataclass(frozen=True)
class EncodedFeatures:
    """Features as they travel: ``count`` rows of ``width`` ``WIRE_DTYPE`` values from position ``start``,
    row-major in ``data``. Whether ``data`` holds what the header says is only checked by ``decode``."""

    start: int
    count: int
    width: int
    data: bytes

    def __len__(self) -> int:
        return self.count

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def wire_bytes(self) -> int:
        return len(self.data)

    @property
    def row_bytes(self) -> int:
        return self.width * WIRE_DTYPE.itemsize

    def tail(self, rows: int) -> EncodedFeatures:
        """The last ``rows`` rows (all when it has fewer; none for rows <= 0)."""
        drop = self.count - max(0, min(rows, self.count))
        if drop == 0:
            return self
        return EncodedFeatures(self.start + drop, self.count - drop, self.width, self.data[drop * self.row_bytes:])

    def head(self, rows: int) -> EncodedFeatures:
        """The first ``rows`` rows (0 <= rows <= count)."""
        return EncodedFeatures(self.start, rows, self.width, self.data[: rows * self.row_bytes])

    def decode(self, field: str, width: int | None = None) -> TargetFeatures:
        """``ValueError`` naming ``field`` unless the data match the stated shape, the width is
        ``width`` (when given) and every value is finite."""
        if self.width == 0 or (width is not None and self.width != width):
            raise ValueError(f"{field}.hidden_size: {self.width}, expected {width}")
        if len(self.data) != self.count * self.row_bytes:
            raise ValueError(f"{field}.bf16_data: {len(self.data)} bytes, expected {self.count * self.row_bytes} "
                             f"(bfloat16 [{self.count}, {self.width}])")
        bits = np.frombuffer(self.data, dtype=_WIRE_BITS).astype(np.uint16).view(np.int16)  # a native copy
        values = torch.from_numpy(bits).view(WIRE_DTYPE).view(self.count, self.width)
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"{field}.bf16_data: not finite")
        return TargetFeatures(self.start, values)


class FeatureRelay:
    """The verdicts' features a relay (the gateway) holds until the drafter's next proposal: the
    newest ones, at most ``max_bytes`` of them (callers pass the message size limit), as received.

    Why a window. A session's draft-length policy may draft nothing for many rounds (k = 0: plain
    decoding wins), and every verdict still brings its features; all of them in one proposal would
    pass the message limit (4 MiB holds 512 positions of a 4096-wide target) and end the drafter
    stream. So only the newest that fit are kept, and the drafter starts its history afresh at the
    window's first position when it is past what it holds (``FeatureHistory``): the head then drafts
    from the window on, as after a long prompt's windowed prefill. Forwarding nothing while not
    drafting instead would leave the first proposal after a plain stretch without the features of
    its recent context. Drafts never decide the output (the verifier does): a shorter history can
    only cost acceptance.

    Parts are consecutive in the order verdicts arrive, except that a migrated verifier resends from
    an earlier position (its rows replace the held ones from there) and a trimmed window leaves a
    gap before it. The payload is never decoded here: the drafter validates it.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._parts: list[EncodedFeatures] = []
        self.nbytes = 0

    def add(self, features: EncodedFeatures | TargetFeatures) -> None:
        if isinstance(features, TargetFeatures):
            features = features.encode()
        if len(features) == 0:
            return
        parts = self._parts
        while parts and (parts[-1].start >= features.start or parts[-1].width != features.width):
            self.nbytes -= parts.pop().wire_bytes  # resent (or of another width): the newer rows win
        if parts and parts[-1].end > features.start:  # overlaps the last part's tail
            last = parts.pop()
            self.nbytes -= last.wire_bytes
            parts.append(last.head(features.start - last.start))
            self.nbytes += parts[-1].wire_bytes
        if parts and parts[-1].end < features.start:  # a gap: what was held can never join these
            self.clear()
        parts.append(features)
        self.nbytes += features.wire_bytes
        while self.nbytes > self.max_bytes:  # drop the oldest rows
            oldest = parts.pop(0)
            self.nbytes -= oldest.wire_bytes
            excess = self.nbytes + oldest.wire_bytes - self.max_bytes
            rows = -(-excess // oldest.row_bytes) if oldest.row_bytes else oldest.count
            kept = oldest.tail(oldest.count - rows)
            if len(kept) and kept.wire_bytes + self.nbytes <= self.max_bytes:
                parts.insert(0, kept)
                self.nbytes += kept.wire_bytes

    def take(self) -> EncodedFeatures | None:
        """Everything held, as one payload (None for none), and empty the relay."""
        if not self._parts:
            return None
        first = self._parts[0]
        joined = EncodedFeatures(first.start, sum(p.count for p in self._parts), first.width,
                                 b"".join(p.data for p in self._parts))
        self.clear()
        return joined

    def clear(self) -> None:
        self._parts.clear()
        self.nbytes = 0
