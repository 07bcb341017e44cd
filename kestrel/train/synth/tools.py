"""Tool-use episodes: a request, the tools on offer (the right one among distractors, or none that fits), the
Kimi K2 call with exact JSON arguments, the tool's result and the reply that reads it.

Every slot value is drawn in the episode's split (places, search topics, addresses, symbols, expressions), and the
user turn comes from that split's phrasings, so held-out episodes are unseen in both wording and content.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kestrel.train.synth.arithmetic import arithmetic_episode
from kestrel.train.synth.episode import TRAIN, Episode, check_split, draw_in_split
from kestrel.train.synth.phrasing import fill
from kestrel.train.synth.places import place
from kestrel.train.synth.tool_schemas import TOOL_NAMES, UNIT_GROUPS, run_tool, tool_schema
from kestrel.train.synth.tool_templates import (
    CALC_WORDS,
    CURRENCY_WORDS,
    DAYS,
    DOMAINS,
    EMAIL_BODIES,
    FIRST_NAMES,
    FOODS,
    LAST_NAMES,
    MODE_WORDS,
    QUERY_PATTERNS,
    TASKS,
    TEMPERATURE_WORDS,
    TEMPLATES,
    THINGS,
    UNIT_WORDS,
)

NO_TOOL = "no_tool"
CATEGORIES = (*TOOL_NAMES, NO_TOOL)
# Tools a request is easily confused with: offered together often, so the choice must be made on the wording.
CONFUSABLE = {
    "get_weather": ("get_local_time", "get_population"),
    "get_local_time": ("get_weather", "get_population"),
    "get_population": ("get_weather", "get_local_time"),
    "get_directions": ("get_weather", "get_local_time"),
    "convert_units": ("convert_currency", "calculator"),
    "convert_currency": ("convert_units", "get_stock_price"),
    "get_stock_price": ("convert_currency", "search_web"),
    "search_web": ("get_stock_price", "send_email"),
    "send_email": ("search_web", "set_timer"),
    "set_timer": ("get_local_time", "send_email"),
    "calculator": ("convert_units", "convert_currency"),
}
TOOL_WEIGHTS = {
    "get_weather": 3.0,
    "get_local_time": 1.5,
    "get_population": 1.5,
    "get_directions": 1.5,
    "convert_units": 1.0,
    "convert_currency": 1.0,
    "search_web": 1.5,
    "get_stock_price": 1.0,
    "send_email": 1.5,
    "set_timer": 0.7,
    "calculator": 1.0,
    NO_TOOL: 1.5,
}
ABILITY = {
    "get_weather": "check the weather",
    "get_local_time": "look up local times",
    "get_population": "look up populations",
    "get_directions": "plan routes",
    "convert_units": "convert units",
    "convert_currency": "convert currencies",
    "search_web": "search the web",
    "get_stock_price": "look up stock prices",
    "send_email": "send emails",
    "set_timer": "set timers",
}


@dataclass(frozen=True)
class Request:
    """What the user asks for: the phrasing family, its slot text, and the exact call that answers it."""

    tool: str
    intent: str
    slots: dict[str, Any]
    args: dict[str, Any]
    wants: str  # for the reasoning: "the weather in Lima"


def _pick_word(rng: random.Random, words: dict[str, list[str]], value: str) -> str:
    return rng.choice(words[value])


def _in_split(rng: random.Random, split: str, kind: str, draw: Callable[[random.Random], Any]) -> Any:
    return draw_in_split(rng, split, draw, lambda v: f"{kind}:{v}")


def _weather(rng: random.Random, split: str) -> Request:
    city = place(rng, split)
    if rng.random() < 0.3:
        unit = rng.choice(list(TEMPERATURE_WORDS))
        slots = {"city": city, "unit": _pick_word(rng, TEMPERATURE_WORDS, unit)}
        args = {"city": city, "unit": unit}
        return Request("get_weather", "weather_unit", slots, args, f"the weather in {city} in {unit}")
    return Request("get_weather", "weather", {"city": city}, {"city": city}, f"the weather in {city}")


def _city_tool(tool: str, intent: str, what: str) -> Callable[[random.Random, str], Request]:
    def make(rng: random.Random, split: str) -> Request:
        city = place(rng, split)
        return Request(tool, intent, {"city": city}, {"city": city}, f"the {what} in {city}")

    return make


def _directions(rng: random.Random, split: str) -> Request:
    origin = place(rng, split)
    destination = place(rng, split)
    while destination == origin:
        destination = place(rng, split)
    args: dict[str, Any] = {"origin": origin, "destination": destination}
    slots = dict(args)
    intent, wants = "directions", f"a route from {origin} to {destination}"
    if rng.random() < 0.3:
        mode = rng.choice(list(MODE_WORDS))
        slots["mode"], args["mode"] = _pick_word(rng, MODE_WORDS, mode), mode
        intent, wants = "directions_mode", wants + f" ({mode})"
    return Request("get_directions", intent, slots, args, wants)


def _quantity(rng: random.Random) -> int | float:
    return rng.randint(1, 500) if rng.random() < 0.7 else round(rng.uniform(0.5, 99), 1)


def _units(rng: random.Random, split: str) -> Request:
    def draw(r: random.Random) -> tuple[Any, str, str]:
        group = r.choice(UNIT_GROUPS)
        src, dst = r.sample(list(group), 2)
        return _quantity(r), src, dst

    value, src, dst = _in_split(rng, split, "units", draw)
    slots = {"value": value, "from": _pick_word(rng, UNIT_WORDS, src), "to": _pick_word(rng, UNIT_WORDS, dst)}
    args = {"value": value, "from_unit": src, "to_unit": dst}
    return Request("convert_units", "units", slots, args, f"{value} {src} in {dst}")


def _currency(rng: random.Random, split: str) -> Request:
    def draw(r: random.Random) -> tuple[Any, str, str]:
        src, dst = r.sample(list(CURRENCY_WORDS), 2)
        return _quantity(r), src, dst

    amount, src, dst = _in_split(rng, split, "currency", draw)
    slots = {"value": amount, "from": _pick_word(rng, CURRENCY_WORDS, src), "to": _pick_word(rng, CURRENCY_WORDS, dst)}
    args = {"amount": amount, "from": src, "to": dst}
    return Request("convert_currency", "currency", slots, args, f"{amount} {src} in {dst}")


def _fill_topic(rng: random.Random, split: str, patterns: list[str], kind: str) -> str:
    """A search query or e-mail body: a place pattern takes the place's split, the others are split by text."""
    pattern = rng.choice(patterns)
    if "{place}" in pattern:  # so no held-out place enters a training query or body
        return pattern.format(place=place(rng, split), food=rng.choice(FOODS))
    plain = [p for p in patterns if "{place}" not in p]

    def draw(r: random.Random) -> str:
        filler = {"task": r.choice(TASKS), "thing": r.choice(THINGS), "food": r.choice(FOODS), "day": r.choice(DAYS)}
        return r.choice(plain).format(**filler, hour=r.randint(5, 10), n=r.randint(5, 40))

    return _in_split(rng, split, kind, draw)


def _search(rng: random.Random, split: str) -> Request:
    query = _fill_topic(rng, split, QUERY_PATTERNS, "query")
    return Request("search_web", "search", {"query": query}, {"query": query}, f"a web search for {query}")


def _stock(rng: random.Random, split: str) -> Request:
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    symbol = _in_split(rng, split, "symbol", lambda r: "".join(r.choices(letters, k=r.randint(2, 4))))
    return Request("get_stock_price", "stock", {"symbol": symbol}, {"symbol": symbol}, f"the share price of {symbol}")


def _email(rng: random.Random, split: str) -> Request:
    def address(r: random.Random) -> str:
        user = r.choice(FIRST_NAMES) + (f".{r.choice(LAST_NAMES)}" if r.random() < 0.5 else "")
        return f"{user}@{r.choice(DOMAINS)}"

    to = _in_split(rng, split, "address", address)
    body = _fill_topic(rng, split, EMAIL_BODIES, "body")
    return Request("send_email", "email", {"to": to, "body": body}, {"to": to, "body": body}, f"an email to {to}")


def _timer(rng: random.Random, split: str) -> Request:
    minutes = _in_split(rng, split, "minutes", lambda r: r.randint(1, 120))
    return Request("set_timer", "timer", {"minutes": minutes}, {"minutes": minutes}, f"a {minutes}-minute timer")


def _calculator(rng: random.Random, split: str) -> Request:
    def draw(r: random.Random) -> tuple[int, str, int]:
        op = r.choice(list(CALC_WORDS))
        a, b = r.randint(10, 99999), r.randint(2, 9999)
        if op == "/":
            a = b * r.randint(2, 999)
        if op == "-" and b > a:
            a, b = b, a
        return a, op, b

    a, op, b = _in_split(rng, split, "expression", draw)
    expression = f"{a} {op} {b}"
    slots = {"a": a, "op": _pick_word(rng, CALC_WORDS, op), "b": b}
    return Request("calculator", "calculator", slots, {"expression": expression}, f"the value of {expression}")


REQUESTS: dict[str, Callable[[random.Random, str], Request]] = {
    "get_weather": _weather,
    "get_local_time": _city_tool("get_local_time", "time", "local time"),
    "get_population": _city_tool("get_population", "population", "population"),
    "get_directions": _directions,
    "convert_units": _units,
    "convert_currency": _currency,
    "search_web": _search,
    "get_stock_price": _stock,
    "send_email": _email,
    "set_timer": _timer,
    "calculator": _calculator,
}


def request(rng: random.Random, split: str, tool: str) -> Request:
    return REQUESTS[tool](rng, split)


def _offer(rng: random.Random, tool: str, needed: bool) -> list[str]:
    """The tool (if `needed`) among 0-2 distractors (at least one if not), often including a confusable one."""
    others = [n for n in TOOL_NAMES if n != tool]
    picked: list[str] = []
    if rng.random() < 0.5:
        picked.append(rng.choice(CONFUSABLE[tool]))
    k = rng.randint(0 if needed else 1, 2)
    picked += rng.sample([n for n in others if n not in picked], max(0, k - len(picked)))
    offered = ([tool] if needed else []) + picked
    rng.shuffle(offered)
    return offered


def _effort(rng: random.Random) -> str | None:
    return rng.choice([None, None, "high", "max", "low"])


def call_message(tool: str, args: dict[str, Any], reasoning: str) -> dict[str, Any]:
    """The assistant turn that makes one Kimi K2 call (arguments copied verbatim: no \\u escapes)."""
    call = {
        "id": f"functions.{tool}:0",
        "type": "function",
        "function": {"name": tool, "arguments": json.dumps(args, ensure_ascii=False)},
    }
    return {"role": "assistant", "reasoning_content": reasoning, "content": "", "tool_calls": [call]}


def tool_episode(
    rng: random.Random,
    split: str = TRAIN,
    category: str | None = None,
    effort: str | None | bool = False,
    noise: float = 0.1,
    templates: dict[str, list[str]] | None = None,
) -> Episode:
    """A request for `category` (a tool name, or "no_tool": a request none of the offered tools can serve).

    `effort=False` draws a reasoning effort; None or a level fixes it. `templates` (intent → phrasings) replaces the
    split's phrasings (RL asks its own); slot values stay in `split`.
    """
    check_split(split)
    category = category or rng.choices(list(TOOL_WEIGHTS), weights=list(TOOL_WEIGHTS.values()))[0]
    if category not in CATEGORIES:
        raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
    if category == NO_TOOL and rng.random() < 0.2:
        return _arithmetic_among_tools(rng, split, effort, noise)
    tool = rng.choice(list(ABILITY)) if category == NO_TOOL else category
    req = request(rng, split, tool)
    phrasings = templates[req.intent] if templates else TEMPLATES[req.intent][0 if split == TRAIN else 1]
    template = rng.choice(phrasings)
    question = fill(template, req.slots, rng, noise)
    effort = _effort(rng) if effort is False else effort
    meta = {"category": category, "template": template, "intent": req.intent, "slots": req.slots}
    if category == NO_TOOL:
        offered = _offer(rng, tool, needed=False)
        reply = f"Sorry, none of the tools I have can {ABILITY[tool]}."
        reasoning = f"The user wants {req.wants}, but no tool offered can {ABILITY[tool]}. I answer without one."
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "reasoning_content": reasoning, "content": reply},
        ]
        return Episode("tools", messages, [tool_schema(n) for n in offered], effort, None, meta)
    offered = _offer(rng, tool, needed=True)
    call = call_message(tool, req.args, f"The user wants {req.wants}. I will call {tool}.")
    result, reply = run_tool(tool, req.args, rng)
    messages = [
        {"role": "user", "content": question},
        call,
        {"role": "tool", "tool_call_id": f"functions.{tool}:0", "content": json.dumps(result, ensure_ascii=False)},
        {"role": "assistant", "reasoning_content": f"{tool} answered. I report its result.", "content": reply},
    ]
    answer = {"name": tool, "arguments": req.args}
    return Episode("tools", messages, [tool_schema(n) for n in offered], effort, answer, meta)


def _arithmetic_among_tools(rng: random.Random, split: str, effort: str | None | bool, noise: float) -> Episode:
    """An arithmetic question while tools are offered but no calculator: worked out in thought, no call."""
    ep = arithmetic_episode(rng, split, effort=effort, noise=noise)
    offered = rng.sample([n for n in TOOL_NAMES if n != "calculator"], rng.randint(1, 3))
    ep.tools, ep.kind = [tool_schema(n) for n in offered], "tools"
    ep.meta = {**ep.meta, "category": NO_TOOL, "intent": "arithmetic", "slots": {}}
    return ep
