"""The tools episodes can offer: OpenAI function schemas (JSON Schema parameters) and what each call returns.

The schemas are the ones a user would write; `run_tool` plays the environment, returning a plausible result and
the assistant's final reply built from it.
"""

from __future__ import annotations

import random
from typing import Any

CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]
LENGTH_UNITS = {"km": 1000.0, "mi": 1609.344, "m": 1.0, "ft": 0.3048}
MASS_UNITS = {"kg": 1.0, "lb": 0.45359237, "g": 0.001, "oz": 0.028349523125}
VOLUME_UNITS = {"l": 1.0, "gal": 3.785411784}
TEMPERATURE_UNITS = ("c", "f")
UNIT_GROUPS = (LENGTH_UNITS, MASS_UNITS, VOLUME_UNITS, dict.fromkeys(TEMPERATURE_UNITS, 1.0))
ALL_UNITS = [u for group in UNIT_GROUPS for u in group]
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CNY", "INR", "CHF", "CAD")
TRAVEL_MODES = ("driving", "walking", "transit")


def _string(description: str, enum: list[str] | tuple[str, ...] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string", "description": description}
    if enum:
        out["enum"] = list(enum)
    return out


_CITY = _string("City name")
# name → (description, properties, required)
TOOL_DEFS: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "get_weather": (
        "Get the current weather for a city",
        {"city": _CITY, "unit": _string("Temperature unit", ("celsius", "fahrenheit"))},
        ["city"],
    ),
    "get_local_time": ("Get the current local time in a city", {"city": _CITY}, ["city"]),
    "get_population": ("Get the population of a city", {"city": _CITY}, ["city"]),
    "get_directions": (
        "Get a route between two places",
        {"origin": _CITY, "destination": _CITY, "mode": _string("How to travel", TRAVEL_MODES)},
        ["origin", "destination"],
    ),
    "convert_units": (
        "Convert a quantity between units",
        {
            "value": {"type": "number"},
            "from_unit": _string("Unit symbol: " + " ".join(ALL_UNITS)),
            "to_unit": _string("Unit symbol"),
        },
        ["value", "from_unit", "to_unit"],
    ),
    "convert_currency": (
        "Convert money between currencies",
        {
            "amount": {"type": "number"},
            "from": _string("Currency code, e.g. USD"),
            "to": _string("Currency code"),
        },
        ["amount", "from", "to"],
    ),
    "search_web": ("Search the web", {"query": _string("What to search for")}, ["query"]),
    "get_stock_price": ("Get the latest price of a stock", {"symbol": _string("Ticker symbol")}, ["symbol"]),
    "send_email": (
        "Send an email",
        {"to": _string("Recipient address"), "body": _string("Message text")},
        ["to", "body"],
    ),
    "set_timer": ("Start a countdown timer", {"minutes": {"type": "integer", "minimum": 1}}, ["minutes"]),
    "calculator": (
        "Evaluate an arithmetic expression",
        {"expression": _string("For example 12 * 7")},
        ["expression"],
    ),
}
TOOL_NAMES = tuple(TOOL_DEFS)


def tool_schema(name: str) -> dict[str, Any]:
    """The OpenAI `tools` entry for one tool."""
    description, properties, required = TOOL_DEFS[name]
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def convert(value: float, from_unit: str, to_unit: str) -> float:
    if from_unit in TEMPERATURE_UNITS:
        celsius = value if from_unit == "c" else (value - 32) / 1.8
        return round(celsius if to_unit == "c" else celsius * 1.8 + 32, 2)
    group = next(g for g in UNIT_GROUPS if from_unit in g)
    return round(value * group[from_unit] / group[to_unit], 2)


_RATES = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.0, "CNY": 7.2, "INR": 83.0, "CHF": 0.9, "CAD": 1.36}
_UNIT_WORDS = {
    "km": "kilometers",
    "mi": "miles",
    "m": "meters",
    "ft": "feet",
    "kg": "kilograms",
    "lb": "pounds",
    "g": "grams",
    "oz": "ounces",
    "l": "liters",
    "gal": "gallons",
    "c": "°C",
    "f": "°F",
}
_MODE_WORDS = {"driving": "by car", "walking": "on foot", "transit": "by public transport"}


def _number(x: float) -> str:
    return f"{x:g}" if abs(x) < 1e6 else f"{x:,.0f}"


def run_tool(name: str, args: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], str]:
    """(the tool's JSON result, the assistant's reply that reads it) for one call."""
    if name == "get_weather":
        unit = args.get("unit", "celsius")
        t, cond = rng.randint(-10, 38), rng.choice(CONDITIONS)
        t, sym = (t, "°C") if unit == "celsius" else (round(t * 1.8 + 32), "°F")
        result = {"city": args["city"], "temperature": t, "unit": unit, "condition": cond}
        return result, f"It is {t}{sym} and {cond} in {args['city']}."
    if name == "get_local_time":
        hhmm = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        return {"city": args["city"], "time": hhmm}, f"The local time in {args['city']} is {hhmm}."
    if name == "get_population":
        pop = rng.randint(5, 400) * 100_000
        return {"city": args["city"], "population": pop}, f"{args['city']} has a population of about {pop:,}."
    if name == "get_directions":
        mode = args.get("mode", "driving")
        km = rng.randint(2, 900)
        minutes = km * {"driving": 1, "walking": 12, "transit": 2}[mode]
        result = {**args, "distance_km": km, "duration_min": minutes}
        route = f"From {args['origin']} to {args['destination']}"
        reply = f"{route} is {km} km, about {minutes} minutes {_MODE_WORDS[mode]}."
        return result, reply
    if name == "convert_units":
        out = convert(args["value"], args["from_unit"], args["to_unit"])
        src, dst = _UNIT_WORDS[args["from_unit"]], _UNIT_WORDS[args["to_unit"]]
        reply = f"{_number(args['value'])} {src} is {_number(out)} {dst}."
        return {**args, "result": out}, reply
    if name == "convert_currency":
        out = round(args["amount"] * _RATES[args["to"]] / _RATES[args["from"]], 2)
        return {**args, "result": out}, f"{_number(args['amount'])} {args['from']} is {out:.2f} {args['to']}."
    if name == "search_web":
        title = args["query"][:1].upper() + args["query"][1:]
        result = {"results": [{"title": f"{title}: a guide", "url": "https://example.com/guide"}]}
        return result, f'I found a page called "{title}: a guide" at https://example.com/guide.'
    if name == "get_stock_price":
        price = round(rng.uniform(5, 900), 2)
        return {"symbol": args["symbol"], "price": price}, f"{args['symbol']} is trading at {price:.2f}."
    if name == "send_email":
        return {"status": "sent", "to": args["to"]}, f"Done: I sent your email to {args['to']}."
    if name == "set_timer":
        return {"status": "running", "minutes": args["minutes"]}, f"Your {args['minutes']}-minute timer is running."
    if name == "calculator":
        a, op, b = args["expression"].split()
        x, y = int(a), int(b)
        value = {"+": x + y, "-": x - y, "*": x * y, "/": x // y}[op]
        return {"result": value}, f"The answer is {value}."
    raise KeyError(f"run_tool: unknown tool {name!r}")
