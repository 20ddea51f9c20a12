"""Greedy acceptance from teacher-forced agreement, and the shipped draft's export.

Under greedy decoding the draft's proposals in a round are conditioned on the target's accepted text,
so the draft proposes token ``j`` correctly exactly when its top token after the target's first ``j``
answer tokens equals the target's token ``j``. One teacher-forced pass over the target's answer
therefore gives every round's accepted length without running the loop.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_lengths(agree: Sequence[bool], k: int) -> list[int]:
    """Tokens produced per verification (accepted drafts + the one recovered or bonus token)."""
    lengths = []
    position, n = 0, len(agree)
    while position < n:
        run = 0
        while run < k and position + run < n and agree[position + run]:
            run += 1
        produced = min(run + 1, n - position)
        lengths.append(produced)
        position += produced
    return lengths


def mean_accepted_length(lengths: Sequence[int]) -> float | None:
    return sum(lengths) / len(lengths) if lengths else None
