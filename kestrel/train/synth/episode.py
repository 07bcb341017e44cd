"""The episode record shared by every generator, and the rule that puts each slot value in one split."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

TRAIN, HELD_OUT = "train", "held_out"
SPLITS = (TRAIN, HELD_OUT)
HELD_OUT_SHARE = 5  # one value in five is held out

T = TypeVar("T")


@dataclass
class Episode:
    """One conversation; `answer` is the expected final value (number, tool call or reply) for evaluation.

    `meta` names what the evaluation groups by: `category`, the `template` the user turn came from, the slot values.
    """

    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    answer: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


def split_of(key: str) -> str:
    """The split a slot value belongs to: a stable hash of its text, the same on every machine and run."""
    return HELD_OUT if zlib.crc32(key.encode()) % HELD_OUT_SHARE == 0 else TRAIN


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


def draw_in_split(rng: random.Random, split: str, draw: Callable[[random.Random], T], key: Callable[[T], str]) -> T:
    """Redraw until the value falls in `split` (a fifth of draws are held out, so this ends quickly)."""
    for _ in range(1000):
        value = draw(rng)
        if split_of(key(value)) == split:
            return value
    raise RuntimeError(f"no {split} value in 1000 draws")
