"""The local target and draft model of a ``specdec bench`` run, loaded once, only when a system or a
measurement needs them, and the target's forward curve."""

from __future__ import annotations

from specdec.bench.bound import VERIFY_CURVE_TOKENS
from specdec.costs import measure_forward_curve


class ModelCache:
    """Loads --target / --draft-model once, only when a system or a measurement needs them."""

    def __init__(self, args) -> None:
        self.args = args
        self._target = None
        self._draft = None
        self._forward_curve: list[float] | None = None

    def target(self):
        if self._target is None:
            from specdec.models import load_model

            self._target = load_model(self.args.target, device=self.args.device)
        return self._target

    @property
    def loaded_target(self):
        """The target if a system or a measurement has loaded it, else None (loads nothing)."""
        return self._target

    def draft(self):
        from specdec.models import check_compatible, load_model

        if self._draft is None and self.args.draft_model:
            self._draft = load_model(self.args.draft_model, device=self.args.device)
            check_compatible(self.target(), self._draft)
        return self._draft

    def forward_curve(self) -> list[float]:
        """The target's forward over 1..VERIFY_CURVE_TOKENS tokens in this process, measured once."""
        if self._forward_curve is None:
            self._forward_curve = measure_forward_curve(self.target(), VERIFY_CURVE_TOKENS)
        return self._forward_curve

    def drafter(self):
        from specdec.drafters import ModelDrafter
        from specdec.drafting import NgramDrafter

        draft = self.draft()
        return ModelDrafter(draft) if draft is not None else NgramDrafter()
