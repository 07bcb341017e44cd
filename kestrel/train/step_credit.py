"""Step credit: a wrong worked trace is blamed from its first false step on, not for the right steps before it.

GRPO gives every token of a completion its group-normalised advantage. A wrong arithmetic trace is mostly right
steps and one slip (`benchmarks/arithmetic_slips.py`: a carry added wrongly, `5x9=45, 45+6=59`; a borrow where none is
due, `2<2 so`). Where its steps before the slip are a right sample's token for token, the group's pushes on them
cancel (its advantages sum to 0) and those steps learn nothing; where they are right steps a right sample did not
take, the wrong trace pushes them down. With step credit a wrong completion whose trace has a verifiably false step
gets advantage 0 on the tokens before it and its advantage from that step on, so the right samples' push on the
steps every sample got right is no longer cancelled, and the slip keeps its contrast. Right completions, wrong ones
with no false step (a misread question, a miscopied operand) and tool calls keep their advantage on every token.

A step is false when its own arithmetic is (a digit sum, a product, a carry addition, a column subtraction, a
comparison before a borrow, a halving, a tenth, a percentage, the written digit and carry of a sum, the closing
`So a + b = c`); which operands a trace should have read is not checked, so only slips are located.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer


@dataclass(frozen=True)
class Credit:
    """A rollout's advantage and the first output token it applies to (the tokens before it get 0)."""

    advantage: float
    from_token: int = 0

    def per_token(self, n: int) -> list[float]:
        start = min(self.from_token, n)
        return [0.0] * start + [self.advantage] * (n - start)


# Each check: a pattern and a function of its match giving the offset (in the text) where the step goes wrong, or
# None when it is right. The wrong part is the result for a false equation, the operator for a false comparison or
# for a column subtracted the wrong way round (`4-5=0`: the trace should have compared, `4<5 so`).
Check = tuple[re.Pattern[str], Callable[[re.Match[str]], int | None]]


def _result(m: re.Match[str], ok: bool, group: int) -> int | None:
    return None if ok else m.start(group)


def _subtraction(m: re.Match[str]) -> int | None:
    a, b, c = int(m[1]), int(m[2]), int(m[3])
    if a < b:
        return m.end(1)  # the operator: this column needed a borrow
    return _result(m, a - b == c, 3)


def _write_carry(m: re.Match[str]) -> int | None:
    s, w, c = int(m[1]), int(m[2]), int(m[3])
    if w != s % 10:
        return m.start(2)
    return _result(m, c == s // 10, 3)


def _halving(m: re.Match[str]) -> int | None:
    v, q = int(m[1]), int(m[2])
    if q != v // 2:
        return m.start(2)
    return None if bool(m[3]) == bool(v % 2) else m.end(2)


CHECKS: tuple[Check, ...] = (
    (re.compile(r"(\d+)\+(\d+)\+(\d+)=(\d+)"), lambda m: _result(m, int(m[1]) + int(m[2]) + int(m[3]) == int(m[4]), 4)),
    (re.compile(r"(?<![\d+])(\d+)\+(\d+)=(\d+)"), lambda m: _result(m, int(m[1]) + int(m[2]) == int(m[3]), 3)),
    (re.compile(r"(\d+)x(\d+)=(\d+)"), lambda m: _result(m, int(m[1]) * int(m[2]) == int(m[3]), 3)),
    (re.compile(r"(\d+)-(\d+)=(\d+)"), _subtraction),
    (re.compile(r"(\d+)<(\d+) so"), lambda m: None if int(m[1]) < int(m[2]) else m.end(1)),
    (re.compile(r"=(\d+), write (\d+) carry (\d+)"), _write_carry),
    (re.compile(r"(\d+)/2=(\d+)( r1)?"), _halving),
    (re.compile(r"(\d+) / 10 = (\d+)"), lambda m: _result(m, int(m[1]) // 10 == int(m[2]), 2)),
    (re.compile(r"half of (\d+) is (\d+)"), lambda m: _result(m, int(m[1]) // 2 == int(m[2]), 2)),
    (re.compile(r"(\d+)% of (\d+) is (\d+)\."), lambda m: _result(m, int(m[1]) * int(m[2]) // 100 == int(m[3]), 3)),
    (re.compile(r"(\d+) \+ (\d+) = (\d+)"), lambda m: _result(m, int(m[1]) + int(m[2]) == int(m[3]), 3)),
    (re.compile(r"(\d+) - (\d+) = (-?\d+)"), lambda m: _result(m, int(m[1]) - int(m[2]) == int(m[3]), 3)),
    (re.compile(r"(\d+) x (\d+) = (\d+)"), lambda m: _result(m, int(m[1]) * int(m[2]) == int(m[3]), 3)),
)


def first_false_step(text: str) -> int | None:
    """The offset in `text` where its worked trace (the reasoning, up to `</think>`) first goes wrong, or None."""
    trace = text.split("</think>")[0]
    wrong = [at for pattern, check in CHECKS for m in pattern.finditer(trace) if (at := check(m)) is not None]
    return min(wrong, default=None)


def token_at(tok: Tokenizer, ids: list[int], offset: int) -> int:
    """The index of the token of `ids` whose decoded text covers character `offset` of `tok.decode(ids)`: the
    first k whose prefix ids[:k + 1] decodes past it (binary search; a prefix's text only grows with k)."""
    lo, hi = 0, len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tok.decode(ids[: mid + 1])) > offset:
            hi = mid
        else:
            lo = mid + 1
    return lo


def step_credit(tok: Tokenizer, ids: list[int], advantage: float, locate: Callable[[str], int | None] | None) -> Credit:
    """A negative advantage applies from the token of the first false step `locate` finds in the completion."""
    if advantage >= 0 or locate is None or not ids:
        return Credit(advantage)
    offset = locate(tok.decode(ids))
    return Credit(advantage) if offset is None else Credit(advantage, token_at(tok, ids, offset))
