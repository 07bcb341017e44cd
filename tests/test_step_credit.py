"""Step credit: the first false step of a worked trace, found where it is and nowhere else, and the tokens it blames."""

from __future__ import annotations

import random

import pytest

from kestrel.tokenizer import load_tokenizer
from kestrel.train.recipes import RL_RECIPES, TIED_DIR
from kestrel.train.step_credit import Credit, first_false_step, step_credit, token_at
from kestrel.train.synth.arithmetic import (
    PERCENT_STEP,
    PERCENTS,
    addition_trace,
    multiplication_trace,
    percent_trace,
    subtraction_trace,
)


def test_no_step_of_a_right_trace_is_called_false():
    """The generator's traces (the SFT data's, every operation) have no false step, over many operands."""
    rng = random.Random(0)
    for _ in range(3000):
        a, b = rng.randint(0, 99_999), rng.randint(0, 99_999)
        hi, lo = max(a, b), min(a, b)
        for trace in (addition_trace(a, b), subtraction_trace(hi, lo), multiplication_trace(a, rng.randint(2, 9))):
            assert first_false_step(f"<think>{trace}</think>The answer is 1.") is None, trace
    for p in PERCENTS:
        for k in range(1, 200):
            trace = percent_trace(p, k * PERCENT_STEP[p])
            assert first_false_step(trace) is None, trace


SLIPS = [
    # (right trace, its slip, where the slip is blamed: the text at the offset starts with this)
    (multiplication_trace(947, 3), ("27+1=28", "27+1=29"), "29, write 8"),  # a carry added wrongly
    (multiplication_trace(947, 3), ("4x3=12", "4x3=13"), "13, 12+2"),  # a table product
    (multiplication_trace(947, 3), ("write 4 carry 1", "write 4 carry 2"), "2. 9x3"),  # the carry written
    (subtraction_trace(702, 358), ("7-4=3", "7-4=2"), "2. So"),  # a column difference
    (subtraction_trace(702, 358), ("2<8 so 12-8=4, borrow 1. 5+1=6", "2-8=4. 5"), "-8=4. 5"),  # a borrow skipped
    (subtraction_trace(52, 22), ("2-2=0", "2<2 so 12-2=10, borrow 1"), "<2 so"),  # a borrow where none is due
    (addition_trace(47, 38), ("4+3+1=8", "4+3+1=9"), "9, write 8"),  # a digit sum
    (addition_trace(47, 38), ("= 85", "= 86"), "86."),  # the closing line
    (percent_trace(15, 520), ("12/2=6", "12/2=7"), "7. So half"),  # a halving
    (percent_trace(15, 520), ("So half of 52 is 26", "So half of 52 is 27"), "27. 15%"),
    (percent_trace(15, 520), ("So 15% of 520 is 78", "So 15% of 520 is 79"), "79."),
]


@pytest.mark.parametrize("trace, slip, blamed", SLIPS)
def test_a_slip_is_located_at_its_wrong_part(trace, slip, blamed):
    assert slip[0] in trace
    wrong = trace.replace(slip[0], slip[1], 1)
    at = first_false_step(wrong)
    assert at is not None and wrong[at:].startswith(blamed), (wrong, at)
    # the first of two slips is the one located
    later = wrong + " 3+3+0=7, write 7 carry 0."
    assert first_false_step(later) == at


def test_only_the_reasoning_is_checked_and_a_misread_question_has_no_false_step():
    assert first_false_step("<think>7+8+0=15, write 5 carry 1.</think>So 2+2=5.") is None
    # "What is 947 multiplied by 3?" traced as 343 x 7: every step true, the operands wrong (not a slip)
    assert first_false_step(multiplication_trace(343, 7)) is None


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TIED_DIR)


def test_the_blamed_token_holds_the_offset(tok):
    text = "<think>" + multiplication_trace(947, 3).replace("27+1=28", "27+1=29") + "</think>The answer is 2941."
    ids = tok.encode(text).ids
    decoded = tok.decode(ids)
    at = first_false_step(decoded)
    k = token_at(tok, ids, at)
    assert len(tok.decode(ids[:k])) <= at < len(tok.decode(ids[: k + 1]))
    assert tok.decode(ids[k:]).startswith("29, write")


def test_a_wrong_trace_is_blamed_from_its_slip_a_right_one_everywhere(tok):
    wrong = tok.encode("<think>" + subtraction_trace(702, 358).replace("7-4=3", "7-4=2") + "</think>").ids
    credit = step_credit(tok, wrong, -1.5, first_false_step)
    assert 0 < credit.from_token < len(wrong) and tok.decode(wrong[credit.from_token :]).startswith("2. So")
    per_token = credit.per_token(len(wrong))
    assert per_token[: credit.from_token] == [0.0] * credit.from_token
    assert per_token[credit.from_token :] == [-1.5] * (len(wrong) - credit.from_token)
    assert step_credit(tok, wrong, 0.8, first_false_step) == Credit(0.8)  # a positive advantage: every token
    assert step_credit(tok, wrong, -1.5, None) == Credit(-1.5)  # a task without a locator (tool calls)
    misread = tok.encode(multiplication_trace(343, 7)).ids
    assert step_credit(tok, misread, -1.5, first_false_step) == Credit(-1.5)  # no false step: every token
    assert Credit(-1.0, 10).per_token(4) == [0.0] * 4


def test_the_step_credit_recipe_is_the_shipped_one_with_step_credit():
    mini, step = RL_RECIPES["mini"], RL_RECIPES["mini-step"]
    assert step.config.step_credit and not mini.config.step_credit
    assert step.tasks is mini.tasks and step.model == mini.model
    assert {n: getattr(step.config, n) for n in vars(mini.config) if n != "step_credit"} == {
        n: getattr(mini.config, n) for n in vars(mini.config) if n != "step_credit"
    }
    # every arithmetic task locates a trace's false step; the tool calls have no trace
    assert {t.name: t.locate is not None for t in mini.tasks.tasks} == {
        "sub": True,
        "mul": True,
        "pct": True,
        "add2": True,
        "tools": False,
    }
