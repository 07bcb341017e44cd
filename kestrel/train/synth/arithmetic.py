"""Arithmetic questions with worked traces in `<think>`, built from steps a 7.6M-parameter model can learn.

Each trace is a chain of one-digit facts (a sum, a difference, a product, a half) that the model sees thousands of
times; multi-digit answers are read back from the digits the trace wrote. Operand pairs are split like every other
slot value, so the held-out questions are pairs the model never saw.
"""

from __future__ import annotations

import random
from typing import Any

from kestrel.train.synth.episode import TRAIN, Episode, check_split, draw_in_split
from kestrel.train.synth.phrasing import fill

# The original phrasings are the canonical ones (the evaluation's unseen-operand questions use them).
CANONICAL = {
    "add": ["What is {a} + {b}?", "{a} + {b} = ?", "Compute {a} plus {b}."],
    "sub": ["What is {a} - {b}?", "{a} - {b} = ?", "Compute {a} minus {b}."],
    "mul": ["What is {a} x {b}?", "What is {a} times {b}?", "Compute {a} * {b}."],
    "pct": ["What is {a}% of {b}?"],
}
TRAIN_TEMPLATES = {
    "add": CANONICAL["add"]
    + [
        "What's {a} plus {b}?",
        "Calculate {a} + {b}.",
        "how much is {a} + {b}",
        "Add {a} and {b}.",
        "What do you get when you add {a} to {b}?",
        "Find the sum of {a} and {b}.",
        "{a} plus {b} is what?",
        "Please work out {a} + {b}.",
    ],
    "sub": CANONICAL["sub"]
    + [
        "What's {a} minus {b}?",
        "Calculate {a} - {b}.",
        "how much is {a} - {b}",
        "Take {b} away from {a}.",
        "Find the difference between {a} and {b}.",
        "{a} minus {b} is what?",
        "If I have {a} and give away {b}, how many are left?",
        "Please work out {a} - {b}.",
    ],
    "mul": CANONICAL["mul"]
    + [
        "What's {a} times {b}?",
        "Calculate {a} x {b}.",
        "how much is {a} * {b}",
        "Multiply {a} by {b}.",
        "What is the product of {a} and {b}?",
        "{a} times {b} is what?",
        "What is {b} times {a}?",
        "Please work out {a} x {b}.",
    ],
    "pct": CANONICAL["pct"]
    + [
        "Compute {a}% of {b}.",
        "{a}% of {b} = ?",
        "what's {a} percent of {b}",
        "Find {a}% of {b}.",
        "How much is {a}% of {b}?",
        "What is {a} percent of {b}?",
        "Take {a}% of {b}.",
        "A price of {b} with {a}% off: how much is the discount?",
    ],
}
HELD_OUT_TEMPLATES = {
    "add": [
        "What is the total of {a} and {b}?",
        "Sum up {a} and {b} for me.",
        "I need {a} + {b}, please.",
        "If you add {b} to {a}, what do you get?",
        "{a} and {b} added together make?",
    ],
    "sub": [
        "Subtract {b} from {a}.",
        "What do you get if you subtract {b} from {a}?",
        "I need {a} - {b}, please.",
        "What is {a} take away {b}?",
        "How much is left when {b} is taken from {a}?",
    ],
    "mul": [
        "What is {a} multiplied by {b}?",
        "I need {a} x {b}, please.",
        "Give me the product {a} * {b}.",
        "What do you get if you multiply {a} by {b}?",
        "How much is {b} lots of {a}?",
    ],
    "pct": [
        "Calculate {a} percent of {b}.",
        "What number is {a}% of {b}?",
        "Work out {a}% of {b}, please.",
        "I need {a}% of {b}.",
        "How big is {a}% of {b}?",
    ],
}
# More training phrasings, with the verbs the ones above lack ("subtract", "taken from", "deduct", "total",
# "less"): without them the base read "Subtract {b} from {a}." as an addition, the held-out sub phrasings'
# 0 / 24 (benchmarks/held_out_phrasings.py). Their sentence frames differ from every held-out one (a test checks that
# no held-out phrasing equals one or lies inside one, after normalisation). The `mini-wide` recipe trains on them; the
# original recipes' data stays as it was, so their shipped models still come from their recipes.
WIDER_TRAIN_TEMPLATES = {
    "add": [
        "{a} and {b} make how many in total?",
        "Add up {a} and {b} and give me the total.",
        "Give me the sum {a} + {b}.",
        "{a} added to {b} is?",
        "Increase {a} by {b}.",
        "what's the total when you add {a} and {b}",
    ],
    "sub": [
        "From {a}, subtract {b}.",
        "{a} with {b} subtracted is what?",
        "If {b} is subtracted from {a}, what is the result?",
        "If {b} is taken from {a}, what remains?",
        "Take {b} from {a}. What's left?",
        "{a} less {b} is how much?",
        "Deduct {b} from {a}.",
        "Reduce {a} by {b}.",
    ],
    "mul": [
        "Multiply {a} and {b} together.",
        "{a} groups of {b} is how many?",
        "{a} sets of {b} make how many?",
        "Can you multiply {b} by {a}?",
        "Give me {a} times {b}.",
    ],
    "pct": [
        "What is {a} per cent of {b}?",
        "Determine {a}% of {b}.",
        "Give me {a}% of {b}.",
        "{b} at {a}%: how much is that?",
    ],
}
WIDE_TRAIN_TEMPLATES = {op: TRAIN_TEMPLATES[op] + WIDER_TRAIN_TEMPLATES[op] for op in TRAIN_TEMPLATES}
OPERATION_WEIGHTS = {"add": 2, "sub": 2, "mul": 2, "pct": 2}
DIGIT_CHOICES = {"add": [1, 2, 2, 2, 3], "sub": [1, 2, 2, 3], "mul": [1, 2, 2, 3]}
PERCENTS = (5, 10, 15, 20, 25, 50)
# The multiple of n that keeps every step of a percentage trace whole (5% and 15% halve n / 10).
PERCENT_STEP = {5: 20, 10: 10, 15: 20, 20: 10, 25: 4, 50: 2}


# -- traces -----------------------------------------------------------------------------------------------
def addition_trace(a: int, b: int) -> str:
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry, digits = [], 0, []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s}, write {s % 10} carry {s // 10}.")
        digits.append(str(s % 10))
        carry = s // 10
    if carry:
        digits.append(str(carry))
        steps.append(f"final carry {carry}.")
    return " ".join(steps) + f" So {a} + {b} = {''.join(reversed(digits)).lstrip('0') or '0'}."


def subtraction_trace(a: int, b: int) -> str:
    """Column by column from the right; a borrow is added to the next subtrahend digit before comparing."""
    da, db = str(a)[::-1], str(b)[::-1]
    steps, borrow = [], 0
    for i, ch in enumerate(da):
        x, y = int(ch), int(db[i]) if i < len(db) else 0
        t = y + borrow
        step = f"{y}+1={t}, " if borrow else ""
        if x >= t:
            step, borrow = step + f"{x}-{t}={x - t}.", 0
        else:
            step, borrow = step + f"{x}<{t} so 1{x}-{t}={x + 10 - t}, borrow 1.", 1
        steps.append(step)
    return " ".join(steps) + f" So {a} - {b} = {a - b}."


def multiplication_trace(a: int, d: int) -> str:
    """Digit by digit from the right: the table product first, then the carry added on its own."""
    steps, carry = [], 0
    for ch in str(a)[::-1]:
        p = int(ch) * d
        step = f"{ch}x{d}={p}, "
        if carry:
            step += f"{p}+{carry}={p + carry}, "
            p += carry
        steps.append(step + f"write {p % 10} carry {p // 10}.")
        carry = p // 10
    if carry:
        steps.append(f"final carry {carry}.")
    return " ".join(steps) + f" So {a} x {d} = {a * d}."


def half_trace(n: int) -> str:
    """Long division by 2 from the left: the answer's digits come out in reading order."""
    steps, rem = [], 0
    for ch in str(n):
        v = 10 * rem + int(ch)
        rem = v % 2
        steps.append(f"{v}/2={v // 2}" + (" r1" if rem else ""))
    return f"Half of {n}: " + ", ".join(steps) + f". So half of {n} is {n // 2}."


def percent_trace(p: int, n: int) -> str:
    ten = n // 10
    if p == 10:
        body = f"10% of {n} is {n} / 10 = {ten}."
    elif p == 20:
        body = f"10% of {n} is {ten}. 20% is twice that. {multiplication_trace(ten, 2)}"
    elif p == 5:
        body = f"10% of {n} is {ten}. 5% is half of that. {half_trace(ten)}"
    elif p == 15:
        five = ten // 2
        body = f"10% of {n} is {ten}. 5% is half of that. {half_trace(ten)} 15% is {ten} + {five}. "
        body += addition_trace(ten, five)
    elif p == 25:
        body = f"25% is half of half. {half_trace(n)} {half_trace(n // 2)}"
    elif p == 50:
        body = f"50% is half. {half_trace(n)}"
    else:
        raise ValueError(f"percent_trace: no trace for {p}%")
    return body + f" So {p}% of {n} is {p * n // 100}."


# -- which trace steps an operand pair calls for (the steps the base slips on: benchmarks/arithmetic_slips.py) --------
def carry_crosses_ten(a: int, d: int) -> bool:
    """Some digit product of `a x d` plus the carry into it crosses a ten (the trace step `45+6=51`)."""
    carry = 0
    for digit in reversed(str(a)):
        product = int(digit) * d
        if carry and product % 10 + carry >= 10:
            return True
        carry = (product + carry) // 10
    return False


def carry_comes_in(a: int, b: int) -> bool:
    """Some column of `a + b` adds a carry from the column before (the trace step `3+3+1=7`; the final carry aside)."""
    da, db, carry = str(a)[::-1], str(b)[::-1], 0
    for i in range(max(len(da), len(db))):
        if carry:
            return True
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        carry = (x + y + carry) // 10
    return False


def subtraction_columns(a: int, b: int) -> dict[str, bool]:
    """Whether some column of `a - b` has equal digits after the borrow (`2-2=0`, no borrow due) and whether some
    column needs a borrow (`4<5 so 14-5=9`)."""
    top, bottom, borrow = str(a), str(b).rjust(len(str(a)), "0"), 0
    equal = needs = False
    for x, y in zip(reversed(top), reversed(bottom)):
        due = int(y) + borrow
        equal |= int(x) == due
        borrow = int(int(x) < due)
        needs |= bool(borrow)
    return {"equal_column": equal, "borrow_column": needs}


# -- episodes ---------------------------------------------------------------------------------------------
def _operands(rng: random.Random, op: str, digits: int | None) -> tuple[int, int]:
    if op == "pct":
        p = rng.choice(PERCENTS)
        step = PERCENT_STEP[p]
        return p, step * rng.randint(1, 999 // step)
    nd = digits or rng.choice(DIGIT_CHOICES[op])
    lo, hi = (0 if nd == 1 else 10 ** (nd - 1)), 10**nd - 1
    if op == "add":
        return rng.randint(lo, hi), rng.randint(lo, hi)
    if op == "sub":
        a, b = sorted((rng.randint(lo, hi), rng.randint(lo, hi)), reverse=True)
        return a, b
    return rng.randint(lo, hi), rng.randint(2, 9)


def solve(op: str, a: int, b: int) -> tuple[str, int]:
    """(worked trace, answer) for one question."""
    if op == "add":
        return addition_trace(a, b), a + b
    if op == "sub":
        return subtraction_trace(a, b), a - b
    if op == "mul":
        return multiplication_trace(a, b), a * b
    return percent_trace(a, b), a * b // 100


def _arithmetic_effort(rng: random.Random) -> str | None:
    """Mostly worked traces: a traceless multi-digit answer cannot be learned by a few-million-parameter model."""
    return rng.choices([None, "high", "max", "low"], weights=[4, 2, 2, 1])[0]


def arithmetic_episode(
    rng: random.Random,
    split: str = TRAIN,
    op: str | None = None,
    digits: int | None = None,
    templates: list[str] | None = None,
    effort: str | None | bool = False,
    noise: float = 0.1,
) -> Episode:
    """One question with operands in `split`; phrased from the split's templates unless `templates` is given.

    `effort=False` draws a reasoning effort; None or a level fixes it.
    """
    check_split(split)
    op = op or rng.choices(list(OPERATION_WEIGHTS), weights=list(OPERATION_WEIGHTS.values()))[0]
    a, b = draw_in_split(rng, split, lambda r: _operands(r, op, digits), lambda ab: f"{op}:{ab[0]}:{ab[1]}")
    template = rng.choice(templates or (TRAIN_TEMPLATES if split == TRAIN else HELD_OUT_TEMPLATES)[op])
    question = fill(template, {"a": a, "b": b}, rng, noise)
    trace, answer = solve(op, a, b)
    effort = _arithmetic_effort(rng) if effort is False else effort
    if effort == "low":
        trace = f"The answer is {answer}."
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": question},
        {"role": "assistant", "reasoning_content": trace, "content": f"The answer is {answer}."},
    ]
    meta = {"category": op, "op": op, "a": a, "b": b, "template": template}
    return Episode("arithmetic", messages, None, effort, answer, meta)


def wide_arithmetic_episode(rng: random.Random, split: str = TRAIN) -> Episode:
    """`arithmetic_episode` phrased from the wider training set (held-out questions keep the held-out phrasings)."""
    op = rng.choices(list(OPERATION_WEIGHTS), weights=list(OPERATION_WEIGHTS.values()))[0]
    return arithmetic_episode(rng, split, op, templates=WIDE_TRAIN_TEMPLATES[op] if split == TRAIN else None)
