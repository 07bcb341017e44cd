"""Held-out accuracy of a chat model, per category: exact final answers per arithmetic operation, exact tool name
+ JSON arguments per tool (and no call where no offered tool fits), and verbatim copies of fresh pseudo-word spans.

Every question uses held-out phrasings and slot values (operand pairs, places, topics, addresses) that the training
generator never produces, so a score measures generalisation; `n` questions are asked per category.
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from kestrel.chat_template import THINK_END, render_chat
from kestrel.engine.llm import LLM
from kestrel.engine.sampling_params import SamplingParams
from kestrel.train.synth.arithmetic import CANONICAL, arithmetic_episode
from kestrel.train.synth.copying import drill_reply, random_span_episode
from kestrel.train.synth.episode import HELD_OUT, Episode
from kestrel.train.synth.places import REAL_PLACES
from kestrel.train.synth.tool_schemas import tool_schema
from kestrel.train.synth.tools import CATEGORIES, NO_TOOL, tool_episode

HELD_OUT_SEED = 10_000
ARITHMETIC_OPS = {"add2": ("add", 2), "sub": ("sub", None), "mul": ("mul", None), "pct": ("pct", None)}
PLACE_SLOTS = ("city", "origin", "destination")
_CALL = re.compile(
    r"<\|tool_call_begin\|>functions\.([\w.-]+):\d+<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S
)
_NUMBER = re.compile(r"-?\d[\d,]*")
# The failures reported in issue 18, asked verbatim (answers: a call, or a number).
ISSUE_PROBES: list[tuple[str, list[str], Any]] = [
    ("What's the weather in Springfield?", ["get_weather"], ("get_weather", {"city": "Springfield"})),
    ("Could you check the weather in Mumbai for me?", ["get_weather"], ("get_weather", {"city": "Mumbai"})),
    ("Is it raining in Nairobi right now?", ["get_weather"], ("get_weather", {"city": "Nairobi"})),
    ("What is 15% of 240?", [], 36),
]


def final_answer(text: str) -> int | None:
    """The last integer in the answer part (after </think>)."""
    answer = text.split(THINK_END)[-1]
    numbers = _NUMBER.findall(answer)
    return int(numbers[-1].replace(",", "")) if numbers else None


def tool_calls(text: str) -> list[tuple[str, Any]]:
    calls = []
    for name, args in _CALL.findall(text):
        try:
            calls.append((name, json.loads(args)))
        except json.JSONDecodeError:
            calls.append((name, None))
    return calls


def _generate(llm: LLM, prompts: list[str], max_tokens: int, lora_name: str | None) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False, lora_name=lora_name)]


def prompt_text(ep: Episode) -> str:
    """The episode's first user turn as a generation prompt (its tools and reasoning effort included)."""
    return render_chat(ep.messages[:1], ep.tools, True, ep.reasoning_effort)


def arithmetic_cases(n: int, seed: int = HELD_OUT_SEED) -> list[tuple[str, Episode]]:
    """n held-out operand pairs per operation in the canonical phrasings, n more in held-out phrasings."""
    rng = random.Random(seed)
    cases = []
    for key, (op, digits) in ARITHMETIC_OPS.items():
        cases += [(key, arithmetic_episode(rng, HELD_OUT, op, digits, CANONICAL[op], "high", 0.0)) for _ in range(n)]
        cases += [(f"{key}_paraphrased", arithmetic_episode(rng, HELD_OUT, op, digits, None, "high")) for _ in range(n)]
    return cases


def tool_cases(n: int, seed: int = HELD_OUT_SEED) -> list[tuple[str, Episode]]:
    """n held-out requests per tool, and n that no offered tool can serve."""
    rng = random.Random(seed + 1)
    return [(category, tool_episode(rng, HELD_OUT, category)) for category in CATEGORIES for _ in range(n)]


def tool_call_correct(ep: Episode, text: str) -> bool:
    """Exactly the expected call (name and parsed arguments), or no call at all where none applies."""
    calls = tool_calls(text)
    if ep.meta["category"] == NO_TOOL:
        return calls == []
    return calls == [(ep.answer["name"], ep.answer["arguments"])]


def arithmetic_correct(ep: Episode, text: str) -> bool:
    """The last integer after </think> is the episode's answer."""
    return final_answer(text) == ep.answer


Grades = list[dict[str, bool]]  # per question: {category key: right?} (a question can count in several keys)


def _grade(cases: list[tuple[str, Episode]], outputs: list[str], correct: Callable[[Episode, str], bool]) -> Grades:
    """Each question under its category, and tool requests also under their places' origin (real or made up)."""
    grades = []
    for (key, ep), text in zip(cases, outputs):
        ok = correct(ep, text)
        row = {key: ok}
        places = [ep.meta["slots"][s] for s in PLACE_SLOTS if s in ep.meta.get("slots", {})]
        if places:
            row["place:real" if all(p in REAL_PLACES for p in places) else "place:made_up"] = ok
        grades.append(row)
    return grades


def accuracy(grades: Grades, mean: bool = True) -> dict[str, float]:
    """Accuracy per key, in first-seen order; `mean`: also the mean over categories (keys without a ':')."""
    right: dict[str, list[bool]] = defaultdict(list)
    for row in grades:
        for key, ok in row.items():
            right[key].append(ok)
    scores = {key: sum(v) / len(v) for key, v in right.items()}
    per_category = [v for key, v in scores.items() if ":" not in key]
    return scores | ({"mean": sum(per_category) / len(per_category)} if mean else {})


def grade_arithmetic(llm: LLM, n: int = 200, seed: int = HELD_OUT_SEED, lora_name: str | None = None) -> Grades:
    """Per question of `arithmetic_cases`: the exact final answer?"""
    cases = arithmetic_cases(n, seed)
    return _grade(cases, _generate(llm, [prompt_text(ep) for _, ep in cases], 256, lora_name), arithmetic_correct)


def grade_tools(llm: LLM, n: int = 200, seed: int = HELD_OUT_SEED, lora_name: str | None = None) -> Grades:
    """Per question of `tool_cases`: exactly the expected call (or none)?"""
    cases = tool_cases(n, seed)
    return _grade(cases, _generate(llm, [prompt_text(ep) for _, ep in cases], 128, lora_name), tool_call_correct)


def eval_arithmetic(
    llm: LLM, n: int = 200, seed: int = HELD_OUT_SEED, lora_name: str | None = None
) -> dict[str, float]:
    """Accuracy per operation (2-digit addition, subtraction, one-digit multiplication, percentages)."""
    return accuracy(grade_arithmetic(llm, n, seed, lora_name))


def eval_tools(llm: LLM, n: int = 200, seed: int = HELD_OUT_SEED, lora_name: str | None = None) -> dict[str, float]:
    """Accuracy per tool (exact name + JSON arguments), `no_tool`, and by place origin (real or made up)."""
    return accuracy(grade_tools(llm, n, seed, lora_name))


def copy_grades(cases: list[Episode], outputs: list[str]) -> Grades:
    """`copy_random`: the reply is exactly the span; `copy_random:in_reasoning`: the reasoning repeats it (the same
    pieces as in the user turn, where the reply's first piece lacks the leading space)."""
    return [
        {
            "copy_random": text.split(THINK_END)[-1].strip() == ep.answer,
            "copy_random:in_reasoning": drill_reply(ep.answer)["reasoning_content"] in text.split(THINK_END)[0],
        }
        for ep, text in zip(cases, outputs)
    ]


def copy_scores(cases: list[Episode], outputs: list[str]) -> dict[str, float]:
    """Accuracy of `copy_grades`."""
    return accuracy(copy_grades(cases, outputs), mean=False)


def grade_copy(llm: LLM, n: int = 200, seed: int = HELD_OUT_SEED, lora_name: str | None = None) -> Grades:
    """Verbatim copies of n fresh pseudo-word spans asked in held-out phrasings: the skill a tool call's arguments
    need, with nothing to memorise."""
    rng = random.Random(seed + 2)
    cases = [random_span_episode(rng, HELD_OUT) for _ in range(n)]
    return copy_grades(cases, _generate(llm, [prompt_text(ep) for ep in cases], 64, lora_name))


def eval_copy(llm: LLM, n: int = 200, seed: int = HELD_OUT_SEED, lora_name: str | None = None) -> dict[str, float]:
    """Accuracy of `grade_copy`."""
    return accuracy(grade_copy(llm, n, seed, lora_name), mean=False)


def run_probes(llm: LLM, lora_name: str | None = None) -> list[tuple[str, str, bool]]:
    """(question, model output, right?) for the issue's reported failures."""
    prompts = [
        render_chat([{"role": "user", "content": q}], [tool_schema(t) for t in tools] or None, True, "high")
        for q, tools, _ in ISSUE_PROBES
    ]
    out = []
    for (question, _, want), text in zip(ISSUE_PROBES, _generate(llm, prompts, 256, lora_name)):
        ok = tool_calls(text) == [want] if isinstance(want, tuple) else final_answer(text) == want
        out.append((question, text, ok))
    return out


# Each text task's grader and whether its scores have a "mean" (copy's two keys are one question's two readings).
GRADERS: dict[str, tuple[Callable[..., Grades], bool]] = {
    "arithmetic": (grade_arithmetic, True),
    "tools": (grade_tools, True),
    "copy": (grade_copy, False),
}
