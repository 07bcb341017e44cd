"""Fill a phrasing template, with the noise users type: lower case, no final punctuation, a typo.

Noise touches the template's own words only; slot values (a city, an e-mail body) are copied as given, so the
expected tool arguments stay exact.
"""

from __future__ import annotations

import random
import re
from typing import Any

_SLOT = re.compile(r"\{(\w+)\}")


def literal_parts(template: str) -> tuple[list[str], list[str]]:
    """The text between slots and the slot names, interleaved: parts[0] slot[0] parts[1] ... parts[-1]."""
    pieces = _SLOT.split(template)
    return pieces[0::2], pieces[1::2]


def _typo(text: str, rng: random.Random) -> str:
    words = [m for m in re.finditer(r"[A-Za-z]{4,}", text)]
    if not words:
        return text
    w = rng.choice(words)
    s, i = w.group(), rng.randrange(1, len(w.group()) - 1)
    kind = rng.choice(["swap", "drop", "double"])
    new = {"swap": s[:i] + s[i + 1] + s[i] + s[i + 2 :], "drop": s[:i] + s[i + 1 :], "double": s[:i] + s[i] + s[i:]}
    return text[: w.start()] + new[kind] + text[w.end() :]


def fill(template: str, slots: dict[str, Any], rng: random.Random | None = None, noise: float = 0.0) -> str:
    """`template` with its slots filled; with probability `noise` each, lower-case it, strip the end, add a typo."""
    parts, names = literal_parts(template)
    if rng is not None and noise > 0:
        if rng.random() < noise:
            parts = [p.lower() for p in parts]
        if rng.random() < noise:
            parts[-1] = parts[-1].rstrip("?.!")
        if rng.random() < noise:
            i = rng.randrange(len(parts))
            parts[i] = _typo(parts[i], rng)
    out = parts[0]
    for name, part in zip(names, parts[1:]):
        out += str(slots[name]) + part
    return out


def normalized(template: str) -> str:
    """A template compared without case, punctuation or spacing: two templates equal here are one phrasing."""
    return " ".join(re.sub(r"[^\w{} ]", " ", template.lower()).split())
