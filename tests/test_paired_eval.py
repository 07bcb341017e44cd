"""`kestrel eval --paired`: an adapter against its base on the same questions (gained / lost answers, McNemar)."""

import math

import pytest

from kestrel.train.evaluate import accuracy
from kestrel.train.paired_eval import compare, mcnemar_p


def test_mcnemar_exact_p_is_the_two_sided_binomial_tail_of_the_discordant_pairs():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(5, 0) == mcnemar_p(0, 5) == 2 / 2**5
    assert mcnemar_p(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 2**12)  # 0.0386: significant at 5%
    assert mcnemar_p(3, 3) == 1.0  # a split as even as can be is capped at 1
    assert mcnemar_p(7, 5) == pytest.approx(min(1.0, 2 * sum(math.comb(12, i) for i in range(6)) / 2**12))


def test_compare_counts_the_answers_the_adapter_changed_per_category_and_over_the_categories():
    base = [{"sub": False}, {"sub": False}, {"sub": True}, {"sub": True}, {"mul": True, "place:real": True}]
    adapted = [{"sub": True}, {"sub": True}, {"sub": True}, {"sub": False}, {"mul": True, "place:real": True}]
    scores = compare(base, adapted)
    sub = scores["sub"]
    assert (sub.base, sub.adapted, sub.gained, sub.lost, sub.n) == (0.5, 0.75, 2, 1, 4)
    assert sub.p_value == mcnemar_p(2, 1) == 1.0
    assert (scores["mul"].gained, scores["mul"].lost, scores["place:real"].n) == (0, 0, 1)
    mean = scores["mean"]  # over categories (keys without ':'), as `accuracy` reports it
    assert (mean.base, mean.adapted) == (accuracy(base)["mean"], accuracy(adapted)["mean"]) == (0.75, 0.875)
    assert (mean.gained, mean.lost, mean.n) == (2, 1, 5)
    assert "mean" not in compare(base, adapted, mean=False)
    assert "0.500 -> 0.750 (+25.0 pts; +2 -1 of 4" in sub.line()


def test_compare_refuses_grades_of_different_questions():
    with pytest.raises(ValueError, match="same questions"):
        compare([{"sub": True}], [{"sub": True}, {"sub": False}])
    with pytest.raises(ValueError, match="same questions"):
        compare([{"sub": True}], [{"mul": True}])
