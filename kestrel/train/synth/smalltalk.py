"""Small talk, sometimes with tools on offer that the reply must not call."""

from __future__ import annotations

import random

from kestrel.train.synth.episode import TRAIN, Episode, check_split
from kestrel.train.synth.tool_schemas import TOOL_NAMES, tool_schema

GREETINGS = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi", "Hi there! What can I do for you?"),
    ("Hey, how are you?", "I'm doing well, thank you! How can I help?"),
    ("Good morning!", "Good morning! What would you like to know?"),
    ("Who are you?", "I am Kestrel Mini, a small assistant that can do arithmetic and call tools."),
    (
        "What can you do?",
        "I can solve arithmetic problems and use tools: weather, local time, population, routes, unit and currency "
        "conversion, web search, stock prices, email, timers and a calculator.",
    ),
    ("Thanks!", "You're welcome!"),
    ("Thank you very much.", "Happy to help!"),
    ("Goodbye", "Goodbye! Have a great day."),
    ("Tell me a joke.", "Why did the cat sit on the computer? To keep an eye on the mouse."),
    ("Good night", "Good night! Sleep well."),
    ("How old are you?", "I was trained recently, so I am quite new."),
]


def smalltalk_episode(rng: random.Random, split: str = TRAIN) -> Episode:
    check_split(split)
    user, reply = rng.choice(GREETINGS)
    messages = [
        {"role": "user", "content": user},
        {"role": "assistant", "reasoning_content": "A friendly message. I reply politely.", "content": reply},
    ]
    tools = [tool_schema(n) for n in rng.sample(TOOL_NAMES, rng.randint(0, 2))] or None
    effort = rng.choice([None, None, "high", "max", "low"])
    return Episode("smalltalk", messages, tools, effort, reply, {"category": "smalltalk"})
