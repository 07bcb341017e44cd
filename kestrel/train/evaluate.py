"""Held-out accuracy of a chat model: exact final answers on arithmetic, exact tool name + JSON arguments."""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from typing import Any

from kestrel.chat_template import THINK_END, render_chat
from kestrel.engine.llm import LLM
from kestrel.engine.sampling_params import SamplingParams
from kestrel.train.data import Episode, arithmetic_episode, tool_episode

HELD_OUT_SEED = 10_000
_CALL = re.compile(
    r"<\|tool_call_begin\|>functions\.([\w.-]+):\d+<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S
)
_NUMBER = re.compile(r"-?\d[\d,]*")


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


def _generate(llm: LLM, prompts: list[str], max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def arithmetic_cases(n: int, seed: int = HELD_OUT_SEED) -> list[tuple[str, Episode]]:
    """n held-out questions per operation: 2-digit addition (`add2`), subtraction, multiplication, percentages."""
    rng = random.Random(seed)
    cases = [("add2", arithmetic_episode(rng, "add", 2)) for _ in range(n)]
    return cases + [(op, arithmetic_episode(rng, op)) for op in ("sub", "mul", "pct") for _ in range(n)]


def tool_cases(n: int, seed: int = HELD_OUT_SEED) -> list[tuple[str, Episode]]:
    """n held-out tool requests, keyed by the tool they need."""
    rng = random.Random(seed + 1)
    return [(ep.answer["name"], ep) for ep in (tool_episode(rng) for _ in range(n))]


def tool_call_correct(ep: Episode, text: str) -> bool:
    """Exactly one call, of the expected tool with the expected (parsed) arguments."""
    return tool_calls(text) == [(ep.answer["name"], ep.answer["arguments"])]


def arithmetic_correct(ep: Episode, text: str) -> bool:
    return final_answer(text) == ep.answer


def prompt_text(ep: Episode) -> str:
    """The episode's first user turn as a generation prompt (tools and reasoning effort included)."""
    return render_chat(ep.messages[:1], ep.tools, True, ep.reasoning_effort)


def eval_arithmetic(llm: LLM, n: int = 200, seed: int = HELD_OUT_SEED) -> dict[str, float]:
    """Accuracy per operation on n held-out questions each (reasoning effort high)."""
    cases = arithmetic_cases(n, seed)
    outputs = _generate(llm, [render_chat(ep.messages[:1], None, True, "high") for _, ep in cases], 160)
    right: dict[str, list[bool]] = defaultdict(list)
    for (kind, ep), text in zip(cases, outputs):
        right[kind].append(arithmetic_correct(ep, text))
    return {kind: sum(v) / len(v) for kind, v in right.items()}


def eval_tools(llm: LLM, n: int = 200, seed: int = HELD_OUT_SEED) -> dict[str, float]:
    """Share of held-out tool requests answered with exactly one call of the right tool and arguments."""
    cases = tool_cases(n, seed)
    outputs = _generate(llm, [prompt_text(ep) for _, ep in cases], 96)
    exact = [tool_call_correct(ep, text) for (_, ep), text in zip(cases, outputs)]
    return {"tool_call_exact": sum(exact) / len(exact)}
