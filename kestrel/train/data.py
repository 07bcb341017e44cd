"""Deterministic synthetic chat episodes: worked arithmetic, tool use over ~50 cities, small talk.

Every episode is an OpenAI-style conversation (messages + optional tools + reasoning effort), so the same
data drives the tokenizer, the SFT trainer and the evaluation. A seed fully determines the stream.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

CITIES = [
    "Beijing",
    "Shanghai",
    "Tokyo",
    "Osaka",
    "Seoul",
    "Singapore",
    "Bangkok",
    "Jakarta",
    "Manila",
    "Hanoi",
    "Delhi",
    "Mumbai",
    "Karachi",
    "Dhaka",
    "Dubai",
    "Istanbul",
    "Cairo",
    "Lagos",
    "Nairobi",
    "Johannesburg",
    "Paris",
    "London",
    "Berlin",
    "Madrid",
    "Rome",
    "Vienna",
    "Prague",
    "Warsaw",
    "Stockholm",
    "Oslo",
    "Helsinki",
    "Dublin",
    "Lisbon",
    "Athens",
    "Moscow",
    "Kyiv",
    "Toronto",
    "Vancouver",
    "Montreal",
    "Chicago",
    "Boston",
    "Seattle",
    "Denver",
    "Houston",
    "Miami",
    "Mexico City",
    "Lima",
    "Bogota",
    "Santiago",
    "Sydney",
]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]

TOOL_SPECS: dict[str, dict[str, Any]] = {
    "get_weather": {"description": "Get the current weather for a city", "city": True},
    "get_local_time": {"description": "Get the current local time in a city", "city": True},
    "get_population": {"description": "Get the population of a city", "city": True},
    "search_web": {"description": "Search the web", "params": {"query": {"type": "string"}}},
    "convert_currency": {
        "description": "Convert an amount between currencies",
        "params": {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
    },
    "get_stock_price": {"description": "Get the latest price of a stock", "params": {"symbol": {"type": "string"}}},
    "send_email": {"description": "Send an email", "params": {"to": {"type": "string"}, "body": {"type": "string"}}},
}
CITY_TOOLS = ("get_weather", "get_local_time", "get_population")

WEATHER_QUESTIONS = [
    "What's the weather in {c}?",
    "What is the weather like in {c}?",
    "How is the weather in {c}?",
    "Is it raining in {c}?",
    "Tell me the weather in {c}.",
    "weather in {c}?",
    "How hot is it in {c}?",
]
TIME_QUESTIONS = [
    "What time is it in {c}?",
    "What's the local time in {c}?",
    "Tell me the time in {c}.",
    "current time in {c}?",
]
POPULATION_QUESTIONS = [
    "What is the population of {c}?",
    "How many people live in {c}?",
    "What's the population of {c}?",
    "population of {c}?",
]
GREETINGS = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi", "Hi there! What can I do for you?"),
    ("Hey, how are you?", "I'm doing well, thank you! How can I help?"),
    ("Good morning!", "Good morning! What would you like to know?"),
    ("Who are you?", "I am Kestrel Mini, a small assistant that can do arithmetic and call tools."),
    ("What can you do?", "I can solve arithmetic problems and look up weather, time and population with tools."),
    ("Thanks!", "You're welcome!"),
    ("Thank you very much.", "Happy to help!"),
    ("Goodbye", "Goodbye! Have a great day."),
    ("Tell me a joke.", "Why did the cat sit on the computer? To keep an eye on the mouse."),
]


def tool_schema(name: str) -> dict[str, Any]:
    spec = TOOL_SPECS[name]
    props = {"city": {"type": "string"}} if spec.get("city") else spec["params"]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": spec["description"],
            "parameters": {"type": "object", "properties": props, "required": list(props)},
        },
    }


@dataclass
class Episode:
    """One conversation; `answer` is the expected final value (number or tool call) for evaluation."""

    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    answer: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


# -- arithmetic with worked traces ------------------------------------------------------------------------
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
    da, db = str(a)[::-1], str(b)[::-1]
    steps, borrow = [], 0
    for i in range(len(da)):
        x, y = int(da[i]), int(db[i]) if i < len(db) else 0
        x -= borrow
        borrow = 1 if x < y else 0
        steps.append(f"{x + 10 * borrow}-{y}={x + 10 * borrow - y}, borrow {borrow}.")
    return " ".join(steps) + f" So {a} - {b} = {a - b}."


def multiplication_trace(a: int, d: int) -> str:
    steps, carry, digits = [], 0, []
    for ch in str(a)[::-1]:
        p = int(ch) * d + carry
        steps.append(f"{ch}x{d}+{carry}={p}, write {p % 10} carry {p // 10}.")
        digits.append(str(p % 10))
        carry = p // 10
    if carry:
        digits.append(str(carry))
    return " ".join(steps) + f" So {a} x {d} = {a * d}."


def percent_trace(p: int, n: int) -> str:
    ten, five = n // 10, n // 20
    parts = {
        5: f"10% of {n} is {ten}. Half of that is {five}. So 5% of {n} is {five}.",
        10: f"10% of {n} is {n} / 10 = {ten}.",
        15: f"10% of {n} is {ten}. 5% is half of that, {five}. {ten} + {five} = {ten + five}.",
        20: f"10% of {n} is {ten}. 20% is twice that: {2 * ten}.",
        25: f"25% is a quarter. Half of {n} is {n // 2}, half again is {n // 4}.",
        50: f"50% is half. Half of {n} is {n // 2}.",
    }
    return parts[p] + f" So {p}% of {n} is {p * n // 100}."


def _effort(rng: random.Random) -> str | None:
    return rng.choice([None, None, "high", "max", "low"])


# Addition carries the digit-sum table that every other operation's trace leans on, so it gets half the
# arithmetic budget; one-digit sums are the table itself.
OPERATION_WEIGHTS = {"add": 3, "sub": 1, "mul": 1, "pct": 1}
DIGIT_CHOICES = {"add": [1, 2, 2, 2, 3]}


def _arithmetic_effort(rng: random.Random) -> str | None:
    """Mostly worked traces: a traceless multi-digit answer cannot be learned by a few-million-parameter model."""
    return rng.choices([None, "high", "max", "low"], weights=[4, 2, 2, 1])[0]


def arithmetic_episode(rng: random.Random, op: str | None = None, digits: int | None = None) -> Episode:
    op = op or rng.choices(list(OPERATION_WEIGHTS), weights=list(OPERATION_WEIGHTS.values()))[0]
    nd = digits or rng.choice(DIGIT_CHOICES.get(op, [1, 2, 2, 3]))
    lo, hi = (0 if nd == 1 else 10 ** (nd - 1)), 10**nd - 1
    if op == "add":
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        q, trace, ans = (
            rng.choice(["What is {a} + {b}?", "{a} + {b} = ?", "Compute {a} plus {b}."]),
            addition_trace(a, b),
            a + b,
        )
    elif op == "sub":
        a, b = sorted((rng.randint(lo, hi), rng.randint(lo, hi)), reverse=True)
        q, trace, ans = (
            rng.choice(["What is {a} - {b}?", "{a} - {b} = ?", "Compute {a} minus {b}."]),
            subtraction_trace(a, b),
            a - b,
        )
    elif op == "mul":
        a, b = rng.randint(lo, hi), rng.randint(2, 9)
        q, trace, ans = (
            rng.choice(["What is {a} x {b}?", "What is {a} times {b}?", "Compute {a} * {b}."]),
            multiplication_trace(a, b),
            a * b,
        )
    else:
        a, b = rng.choice([5, 10, 15, 20, 25, 50]), 20 * rng.randint(1, 25)
        q, trace, ans = "What is {a}% of {b}?", percent_trace(a, b), a * b // 100
    effort = _arithmetic_effort(rng)
    question = q.format(a=a, b=b)
    if effort == "low":
        trace = f"The answer is {ans}."
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "reasoning_content": trace, "content": f"The answer is {ans}."},
    ]
    return Episode("arithmetic", messages, None, effort, ans, {"op": op, "a": a, "b": b})


# -- tool use -----------------------------------------------------------------------------------------------
def _tool_result(name: str, city: str, rng: random.Random) -> tuple[dict[str, Any], str]:
    if name == "get_weather":
        t, cond = rng.randint(-10, 38), rng.choice(CONDITIONS)
        return {"city": city, "temperature_c": t, "condition": cond}, f"It is {t}°C and {cond} in {city}."
    if name == "get_local_time":
        h, m = rng.randint(0, 23), rng.randint(0, 59)
        return {"city": city, "time": f"{h:02d}:{m:02d}"}, f"The local time in {city} is {h:02d}:{m:02d}."
    pop = rng.randint(5, 400) * 100_000
    return {"city": city, "population": pop}, f"{city} has a population of about {pop:,}."


def tool_episode(rng: random.Random, city: str | None = None, tool: str | None = None) -> Episode:
    tool = tool or rng.choice(CITY_TOOLS)
    city = city or rng.choice(CITIES)
    questions = {
        "get_weather": WEATHER_QUESTIONS,
        "get_local_time": TIME_QUESTIONS,
        "get_population": POPULATION_QUESTIONS,
    }[tool]
    question = rng.choice(questions).format(c=city)
    others = [n for n in TOOL_SPECS if n != tool]
    offered = [tool] + rng.sample(others, rng.randint(0, 3))
    rng.shuffle(offered)
    tools = [tool_schema(n) for n in offered]
    args = json.dumps({"city": city})
    call = {"id": f"functions.{tool}:0", "type": "function", "function": {"name": tool, "arguments": args}}
    result, answer = _tool_result(tool, city, rng)
    what = {"get_weather": "weather", "get_local_time": "local time", "get_population": "population"}[tool]
    effort = _effort(rng)
    reasoning = f"The user wants the {what} in {city}. I will call {tool}."
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "reasoning_content": reasoning, "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)},
        {"role": "assistant", "reasoning_content": f"The tool returned the {what}.", "content": answer},
    ]
    return Episode("tools", messages, tools, effort, {"name": tool, "arguments": {"city": city}})


def smalltalk_episode(rng: random.Random) -> Episode:
    user, reply = rng.choice(GREETINGS)
    messages = [
        {"role": "user", "content": user},
        {"role": "assistant", "reasoning_content": "A friendly message. I reply politely.", "content": reply},
    ]
    tools = [tool_schema(n) for n in rng.sample(list(TOOL_SPECS), rng.randint(0, 2))] or None
    return Episode("smalltalk", messages, tools, _effort(rng), reply)


def episodes(seed: int, n: int, mix: tuple[float, float, float] = (0.62, 0.28, 0.10)) -> list[Episode]:
    """n episodes drawn with the given (arithmetic, tools, smalltalk) mix; same seed, same list."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < mix[0]:
            out.append(arithmetic_episode(rng))
        elif r < mix[0] + mix[1]:
            out.append(tool_episode(rng))
        else:
            out.append(smalltalk_episode(rng))
    return out
