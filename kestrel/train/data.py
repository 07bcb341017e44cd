"""The SFT data mix: a list of weighted episode sources, drawn from one seeded stream.

A source is any `(rng, split) -> Episode` function, so a new kind of data (images, longer tool chains) joins the
recipe by adding one `Source` to its list. A seed fully determines the stream.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kestrel.train.synth.arithmetic import arithmetic_episode, wide_arithmetic_episode
from kestrel.train.synth.copying import copy_episode, random_span_episode
from kestrel.train.synth.episode import HELD_OUT, TRAIN, Episode, check_split
from kestrel.train.synth.smalltalk import smalltalk_episode
from kestrel.train.synth.tools import tool_episode

__all__ = [
    "COPY_DRILLS",
    "HELD_OUT",
    "MINI_MIX",
    "WIDE_MIX",
    "RANDOM_COPY_DRILLS",
    "TRAIN",
    "Episode",
    "Source",
    "episodes",
]


@dataclass(frozen=True)
class Source:
    """One kind of episode and its share of the mix (weights are relative)."""

    name: str
    weight: float
    make: Callable[[random.Random, str], Episode]


MINI_MIX: tuple[Source, ...] = (
    Source("arithmetic", 0.55, arithmetic_episode),
    Source("tools", 0.37, tool_episode),
    Source("smalltalk", 0.08, smalltalk_episode),
)
# MINI_MIX with arithmetic asked in the wider training phrasings too (`WIDER_TRAIN_TEMPLATES`: the verbs the base
# misread), the same shares.
WIDE_MIX: tuple[Source, ...] = (Source("arithmetic", 0.55, wide_arithmetic_episode), *MINI_MIX[1:])
COPY_DRILLS = Source("copy", 0.08, copy_episode)  # "repeat after me": the span-copying skill of a tool call, alone
RANDOM_COPY_DRILLS = Source("copy_random", 1.0, random_span_episode)  # the same on fresh pseudo-words: copying only


def episodes(seed: int, n: int, sources: Sequence[Source] = MINI_MIX, split: str = TRAIN) -> list[Episode]:
    """n episodes drawn from `sources` by weight; same seed, same list."""
    check_split(split)
    if not sources or any(s.weight < 0 for s in sources) or sum(s.weight for s in sources) <= 0:
        raise ValueError("sources: need at least one source with a positive weight")
    rng = random.Random(seed)
    weights = [s.weight for s in sources]
    return [rng.choices(sources, weights)[0].make(rng, split) for _ in range(n)]
