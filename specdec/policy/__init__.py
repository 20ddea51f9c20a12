"""Draft-length policies: how many tokens to draft in the next round.

- ``base``: ``RoundObservation``, the ``DraftLengthPolicy`` interface, ``FixedDraftLength`` and
  ``HeuristicDraftLength``.
- ``estimators``: acceptance, verify-cost and draft-cost estimators behind the adaptive policy.
- ``config``: ``AdaptiveConfig``, every tunable of the adaptive policy.
- ``adaptive``: ``AdaptiveDraftLength`` (goodput-maximising k, k = 0 included) and ``make_policy``.
- ``memory``: ``AcceptanceMemory``, what recent sessions learned, for warm starts.

See docs/adaptive.md.
"""

from specdec.policy.adaptive import AdaptiveDraftLength, make_policy
from specdec.policy.base import DraftLengthPolicy, FixedDraftLength, HeuristicDraftLength, PolicyMemory, RoundObservation
from specdec.policy.config import AdaptiveConfig
from specdec.policy.estimators import AcceptanceEstimator, DraftCostModel, VerifyCostModel
from specdec.policy.memory import AcceptanceMemory, MemoryEntry, MemoryKey

__all__ = [
    "AcceptanceEstimator",
    "AcceptanceMemory",
    "AdaptiveConfig",
    "AdaptiveDraftLength",
    "DraftCostModel",
    "DraftLengthPolicy",
    "FixedDraftLength",
    "HeuristicDraftLength",
    "MemoryEntry",
    "MemoryKey",
    "PolicyMemory",
    "RoundObservation",
    "VerifyCostModel",
    "make_policy",
]
