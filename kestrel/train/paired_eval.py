"""An adapter against its base on the same held-out questions: per category, both accuracies and the questions whose
answer changed (`kestrel eval --lora X --paired`).

Two unpaired accuracies at n = 200 differ by about 3 points from question sampling alone, so a table of them cannot
tell a small real gain from noise. Asked the same questions, most answers do not change; the ones that do (gained:
the base was wrong and the adapter right; lost: the reverse) carry the whole difference, and McNemar's exact test on
them says how likely a split that uneven is when the adapter is no better or worse than its base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kestrel.train.evaluate import Grades


@dataclass(frozen=True)
class PairedScore:
    """One category: accuracy without and with the adapter, the questions it gained and lost, McNemar's p."""

    base: float
    adapted: float
    gained: int
    lost: int
    n: int
    p_value: float

    def line(self) -> str:
        delta = 100 * (self.adapted - self.base)
        return (
            f"{self.base:.3f} -> {self.adapted:.3f} ({delta:+.1f} pts; +{self.gained} -{self.lost} of {self.n}, "
            f"McNemar p={self.p_value:.3g})"
        )


def mcnemar_p(gained: int, lost: int) -> float:
    """Exact two-sided McNemar test: the chance of a gained/lost split at least this uneven under Binomial(m, 1/2)."""
    m = gained + lost
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(gained, lost) + 1)) / 2**m
    return min(1.0, 2 * tail)


def compare(base: Grades, adapted: Grades, mean: bool = True) -> dict[str, PairedScore]:
    """Per key of the grades (and `mean`: over the categories, keys without ':'), base vs adapted on the same
    questions. Raises ValueError when the two were not graded on the same questions."""
    if len(base) != len(adapted) or any(b.keys() != a.keys() for b, a in zip(base, adapted)):
        raise ValueError("grades: base and adapted must grade the same questions in the same order")
    pairs: dict[str, list[tuple[bool, bool]]] = {}  # key -> (base right, adapted right) per question
    for b_row, a_row in zip(base, adapted):
        for key, b in b_row.items():
            pairs.setdefault(key, []).append((b, a_row[key]))
    out = {}
    for key, rows in pairs.items():
        gained, lost = sum(a and not b for b, a in rows), sum(b and not a for b, a in rows)
        base_acc, adapted_acc = sum(b for b, _ in rows) / len(rows), sum(a for _, a in rows) / len(rows)
        out[key] = PairedScore(base_acc, adapted_acc, gained, lost, len(rows), mcnemar_p(gained, lost))
    if mean:
        categories = [s for k, s in out.items() if ":" not in k]
        gained, lost = sum(s.gained for s in categories), sum(s.lost for s in categories)
        base_mean = sum(s.base for s in categories) / len(categories)  # as `accuracy` means them
        adapted_mean = sum(s.adapted for s in categories) / len(categories)
        n = sum(s.n for s in categories)
        out["mean"] = PairedScore(base_mean, adapted_mean, gained, lost, n, mcnemar_p(gained, lost))
    return out
