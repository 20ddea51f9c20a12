"""The target's features as they travel from the verifier to a feature-level drafter (EAGLE).

``TargetFeatures(start, values)``: row i of ``values`` [n, H] is the target's final-norm input (its
last decoder layer's output) at position ``start + i``. Invariant: a feature at position s is computed
from the committed tokens x_0..x_s only, so it never changes once sent; a verdict carries exactly the
positions whose tokens it committed and whose features no earlier verdict carried.

On the wire they are ``WIRE_DTYPE`` (``EncodedFeatures``): bfloat16, float32's exponent range at 2
bytes a value, so no target's features overflow it (a bf16 target's residual stream can hold values
past float16's 65504, which float16 would send as inf); a bf16 target's features travel unchanged.
The gateway relays them as received, never decoding them (``gateway.feature_relay``); the drafter decodes
and validates them (``decode_features``), so a malformed payload fails that request's drafting only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.wire_types import EncodedFeatures, FieldError

WIRE_DTYPE = torch.bfloat16  # what travels (the proto's TargetFeatures.bf16_data): FEATURE_WIRE_BYTES a value
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


def decode_features(encoded: EncodedFeatures, field: str, width: int | None = None) -> TargetFeatures:
    """The features ``encoded`` carries; ``FieldError`` naming ``field`` unless the data match the
    stated shape, the width is ``width`` (when given) and every value is finite."""
    if encoded.width == 0 or (width is not None and encoded.width != width):
        raise FieldError(f"{field}.hidden_size", f"{encoded.width}, expected {width}")
    if len(encoded.data) != encoded.count * encoded.row_bytes:
        raise FieldError(f"{field}.bf16_data", f"{len(encoded.data)} bytes, expected "
                         f"{encoded.count * encoded.row_bytes} (bfloat16 [{encoded.count}, {encoded.width}])")
    bits = np.frombuffer(encoded.data, dtype=_WIRE_BITS).astype(np.uint16).view(np.int16)  # a native copy
    values = torch.from_numpy(bits).view(WIRE_DTYPE).view(encoded.count, encoded.width)
    if not bool(torch.isfinite(values).all()):
        raise FieldError(f"{field}.bf16_data", "not finite")
    return TargetFeatures(encoded.start, values)
