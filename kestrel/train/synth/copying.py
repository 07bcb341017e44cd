"""Copy drills: the user gives a span (a place, an address, a search topic, a ticker) and asks for it back verbatim.

A tool call is mostly a copy of words the model has never seen; these short episodes put that one skill at a high
density, so the copying circuit forms early in training. Spans come from the tool requests' own slot values, so
they obey the same train / held-out split.

`random_span_episode` is the probe of that skill alone: its spans are fresh pseudo-words, so nothing can be
memorised and only copying lowers the loss on the reply.
"""

from __future__ import annotations

import random

from kestrel.train.synth.episode import TRAIN, Episode, check_split
from kestrel.train.synth.phrasing import fill
from kestrel.train.synth.tools import request

TEMPLATES = (
    [
        "Repeat after me: {text}",
        "Say {text}.",
        "Please echo this: {text}",
        "Copy this exactly: {text}",
        "Write back {text}",
        "repeat {text}",
        "Can you repeat '{text}'?",
        "Type {text} for me.",
        # The span at the start, the middle and the end, bare or quoted: so the drill teaches where a span is by
        # what surrounds it, not by a few fixed sentence shapes (eight templates taught only those eight).
        "I need you to repeat {text} exactly.",
        "{text} - repeat that.",
        "Repeat the words {text}, please.",
        "Can you write {text}?",
        "Please type exactly {text} and nothing else.",
        "Just say {text}",
        'Repeat this phrase: "{text}"',
        "My word is {text}. Say it back.",
        "Copy the text {text} for me.",
        "Return {text} verbatim.",
        "Say '{text}' once.",
        "Please repeat {text} word for word.",
        "Could you type {text}?",
        "Write down {text} exactly as given.",
        "Please copy: {text}",
        "Say the following words: {text}",
        "The phrase is {text}. Repeat it.",
        "{text} is what I want you to repeat.",
        "Hey, repeat {text} for me!",
        "what do you get if you repeat {text}",
    ],
    [
        "Could you say {text} back to me?",
        "Echo the following: {text}",
        "Reply with exactly {text}.",
    ],
)
# Tools whose requests carry a free-text span, and which slot it is in.
SPAN_SLOTS = {
    "get_weather": "city",
    "get_directions": "origin",
    "search_web": "query",
    "send_email": "to",
    "get_stock_price": "symbol",
}


def drill_reply(text: str) -> dict[str, str]:
    """The assistant turn of every drill: reasoning that names the span, then the span alone."""
    return {"role": "assistant", "reasoning_content": f"The user wants {text} repeated.", "content": text}


ONSETS = "b c d f g h k l m n p r s t v w z br tr st pl kr".split()
VOWELS = "a e i o u ai ou ea".split()
CODAS = ["", "", "n", "r", "s", "l"]


def pseudo_word(rng: random.Random) -> str:
    """Two or three consonant-vowel syllables and an optional coda ("Brokamel", "zenaitran"): pronounceable, so BPE
    splits it into ordinary pieces, and one of ~10^7 forms, so a span is practically never seen twice."""
    word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(rng.randint(2, 3))) + rng.choice(CODAS)
    return word.capitalize() if rng.random() < 0.6 else word


def random_span_episode(rng: random.Random, split: str = TRAIN) -> Episode:
    """A drill on one to three fresh pseudo-words; `split` picks the phrasing templates (held-out ones for eval)."""
    check_split(split)
    text = " ".join(pseudo_word(rng) for _ in range(rng.randint(1, 3)))
    template = rng.choice(TEMPLATES[0 if split == TRAIN else 1])
    messages = [{"role": "user", "content": template.format(text=text)}, drill_reply(text)]
    meta = {"category": "copy_random", "template": template, "intent": "copy", "slots": {"text": text}}
    return Episode("copy", messages, None, None, text, meta)


def copy_episode(rng: random.Random, split: str = TRAIN, noise: float = 0.1) -> Episode:
    """One drill: a slot value of `split` in a copy request of `split`; the reply is the value, verbatim."""
    check_split(split)
    tool = rng.choice(list(SPAN_SLOTS))
    text = str(request(rng, split, tool).slots[SPAN_SLOTS[tool]])
    template = rng.choice(TEMPLATES[0 if split == TRAIN else 1])
    messages = [{"role": "user", "content": fill(template, {"text": text}, rng, noise)}, drill_reply(text)]
    effort = rng.choice([None, None, "high", "low"])
    meta = {"category": "copy", "template": template, "intent": "copy", "tool": tool, "slots": {"text": text}}
    return Episode("copy", messages, None, effort, text, meta)
