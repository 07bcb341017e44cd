"""What GRPO trains on: prompts drawn from weighted tasks, each with a verifiable reward, and the held-out questions
its accuracy is measured on.

A `Task` makes training episodes (training-split slot values, asked in the SFT phrasings or in RL's own,
`kestrel.train.synth.rl_phrasings`; never the held-out ones) and says whether a completion is right; the reward is 1.0
for right, 0.0 otherwise. The mini recipe's tasks reuse the evaluation's parsers (`kestrel.train.evaluate`): the exact
tool name and JSON arguments, the exact final arithmetic answer. The held-out questions are the evaluation's own
cases, asked greedily through the rollout engine with the adapter.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from tokenizers import Tokenizer

from kestrel.train import evaluate
from kestrel.train.step_credit import first_false_step
from kestrel.train.synth.arithmetic import (
    TRAIN_TEMPLATES,
    WIDE_TRAIN_TEMPLATES,
    arithmetic_episode,
    carry_comes_in,
    carry_crosses_ten,
    subtraction_columns,
)
from kestrel.train.synth.episode import TRAIN, Episode
from kestrel.train.synth.rl_phrasings import (
    ARITHMETIC_RL_TEMPLATES,
    FRAME_PREFIXES,
    FRAME_SUFFIXES,
    READING_RL_TEMPLATES,
    TOOL_RL_TEMPLATES,
    WORD_RL_TEMPLATES,
)
from kestrel.train.synth.tool_templates import TEMPLATES as TOOL_TEMPLATES
from kestrel.train.synth.tools import tool_episode

Correct = Callable[[Episode, str], bool]  # (episode, completion text) -> right?
Reward = Callable[[Episode, str, list[int]], float]  # (episode, completion text, completion token ids) -> reward
Locate = Callable[[str], int | None]  # completion text -> offset of its first false step (None: none found)


@dataclass(frozen=True)
class Prompt:
    """One RL prompt: its token ids, the episode it came from (what the reward checks), and its task's name."""

    ids: list[int]
    episode: Episode
    task: str


@dataclass(frozen=True)
class Task:
    """One kind of RL prompt: `make(rng)` draws a training episode, `reward` scores one sampled completion, `locate`
    finds where a wrong one first goes wrong (for `--step-credit`; None: the task's completions are not traces)."""

    name: str
    weight: float
    make: Callable[[random.Random], Episode]
    reward: Reward
    locate: Locate | None = None


@dataclass(frozen=True)
class HeldOut:
    """Held-out questions: `cases(n)` gives (category, episode) pairs, `correct` checks one answer."""

    name: str
    cases: Callable[[int], list[tuple[str, Episode]]]
    correct: Correct
    max_new_tokens: int


@dataclass(frozen=True)
class TaskMix:
    """The tasks of a recipe (drawn by weight) and the held-out evaluations its accuracy is reported on."""

    tasks: tuple[Task, ...]
    held_out: tuple[HeldOut, ...] = ()

    def task(self, name: str) -> Task:
        return next(t for t in self.tasks if t.name == name)

    def sample(self, rng: random.Random, n: int, tok: Tokenizer) -> list[Prompt]:
        """n prompts drawn by weight from one seeded stream (the same on every rank)."""
        weights = [t.weight for t in self.tasks]
        out = []
        for _ in range(n):
            task = rng.choices(self.tasks, weights)[0]
            ep = task.make(rng)
            out.append(Prompt(tok.encode(evaluate.prompt_text(ep)).ids, ep, task.name))
        return out

    def held_out_prompts(self, n: int, tok: Tokenizer) -> list[tuple[str, Prompt, Correct, int]]:
        """(category key, prompt, check, token budget) for n questions per category of every held-out evaluation."""
        out = []
        for h in self.held_out:
            for key, ep in h.cases(n):
                prompt = Prompt(tok.encode(evaluate.prompt_text(ep)).ids, ep, h.name)
                out.append((f"{h.name}/{key}", prompt, h.correct, h.max_new_tokens))
        return out


def score(keys: Sequence[str], right: Sequence[bool]) -> dict[str, float]:
    """Accuracy per key."""
    totals: dict[str, list[int]] = {}
    for key, ok in zip(keys, right):
        totals.setdefault(key, []).append(int(ok))
    return {key: sum(v) / len(v) for key, v in sorted(totals.items())}


# -- the mini recipe's tasks (module-level functions and partials: spawned ranks unpickle the mix) ---------------------
# RL asks in the SFT phrasings and its own (never the held-out ones): wording the base has not seen gives the reward
# variance GRPO learns from.
ARITHMETIC_PHRASINGS = {op: TRAIN_TEMPLATES[op] + ARITHMETIC_RL_TEMPLATES[op] for op in TRAIN_TEMPLATES}
# The same for a base trained on the wider phrasings (`kestrel train sft --recipe mini-wide`): its SFT phrasings too.
WIDE_ARITHMETIC_PHRASINGS = {op: WIDE_TRAIN_TEMPLATES[op] + ARITHMETIC_RL_TEMPLATES[op] for op in WIDE_TRAIN_TEMPLATES}
TOOL_PHRASINGS = {intent: train + TOOL_RL_TEMPLATES[intent] for intent, (train, _) in TOOL_TEMPLATES.items()}


def arithmetic_prompt(
    op: str, digits: int | None, rng: random.Random, phrasings: dict[str, list[str]] = ARITHMETIC_PHRASINGS
) -> Episode:
    """A training arithmetic question, asked with the worked trace (reasoning effort high) the reward can improve."""
    ep = arithmetic_episode(rng, TRAIN, op, digits, phrasings[op])
    ep.reasoning_effort = "high"
    return ep


def calls_for_a_slipping_step(op: str, a: int, b: int) -> bool:
    """Whether the operands call for a trace step the base slips on (benchmarks/arithmetic_slips.py): a mul carry
    addition that crosses a ten, a sub column with equal digits or a borrow, or an add column with a carry coming in
    (the step rl16's adapter added twice: README, GRPO)."""
    if op == "mul":
        return carry_crosses_ten(a, b)
    if op == "sub":
        return any(subtraction_columns(a, b).values())
    if op == "add":
        return carry_comes_in(a, b)
    raise ValueError(f"calls_for_a_slipping_step: no slipping step known for {op!r}")


def slip_prompt(
    op: str, digits: int | None, rng: random.Random, phrasings: dict[str, list[str]] = ARITHMETIC_PHRASINGS
) -> Episode:
    """A training `op` question whose operands call for a slipping step: drawn like `arithmetic_prompt` (the same
    phrasings and split), redrawn until they do (about 1 in 6 mul draws, 1 in 2 sub and 2-digit add draws qualify)."""
    for _ in range(1000):
        ep = arithmetic_prompt(op, digits, rng, phrasings)
        if calls_for_a_slipping_step(op, ep.meta["a"], ep.meta["b"]):
            return ep
    raise RuntimeError(f"slip_prompt: no {op} operands with a slipping step in 1000 draws")


def tool_prompt(category: str | None, rng: random.Random) -> Episode:
    """A tool request (of `category`, or one drawn by the generator's weights) in training slot values."""
    return tool_episode(rng, TRAIN, category, templates=TOOL_PHRASINGS)


def exact_answer(ep: Episode, text: str, ids: list[int]) -> float:
    """1.0 when the final integer after </think> is the episode's answer."""
    return float(evaluate.arithmetic_correct(ep, text))


def arithmetic_task(name: str, weight: float, make: Callable[[random.Random], Episode]) -> Task:
    """A task of worked arithmetic questions: the exact final answer rewarded, a wrong trace's first false step
    located (`kestrel.train.step_credit`)."""
    return Task(name, weight, make, exact_answer, first_false_step)


def exact_tool_call(ep: Episode, text: str, ids: list[int]) -> float:
    """1.0 for exactly one call of the expected tool with exactly the expected JSON arguments."""
    return float(evaluate.tool_call_correct(ep, text))


def framed(ep: Episode, rng: random.Random, share: float) -> Episode:
    """`ep` with its user turn inside RL's frames: a prefix with probability `share` and, independently, a suffix.
    The question and its expected answer are unchanged; the frame is recorded in `meta["frame"]`."""
    prefix = rng.choice(FRAME_PREFIXES) if rng.random() < share else ""
    suffix = rng.choice(FRAME_SUFFIXES) if rng.random() < share else ""
    turn = next(m for m in ep.messages if m["role"] == "user")
    turn["content"] = prefix + turn["content"] + suffix
    ep.meta["frame"] = (prefix, suffix)
    return ep


def framed_prompt(make: Callable[[random.Random], Episode], share: float, rng: random.Random) -> Episode:
    """A prompt from `make`, framed by `framed` (a module-level function: spawned ranks unpickle the mix)."""
    return framed(make(rng), rng, share)


def held_out_arithmetic(n: int) -> list[tuple[str, Episode]]:
    """The evaluation's arithmetic cases, asked with the worked trace as `kestrel eval` does."""
    cases = evaluate.arithmetic_cases(n)
    for _, ep in cases:
        ep.reasoning_effort = "high"
    return cases


# Questions whose operands call for the steps the base slips on (benchmarks/arithmetic_slips.py): a mul carry that
# crosses a ten (17% of plain mul draws), a sub column with equal digits or a borrow, and a 2-digit add column with a
# carry coming in. On the base, at T 0.7, the mul and sub ones give a gradient (mixed groups) about twice as often as
# plain draws (benchmarks/grpo_signal.py). rl16 trained on the first two and lost add2 (a carry added twice); rl17
# added add2_slip, which held add2 (README: GRPO).
SLIP_TASKS = (
    arithmetic_task("sub_slip", 1.0, partial(slip_prompt, "sub", None)),
    arithmetic_task("mul_slip", 1.0, partial(slip_prompt, "mul", None)),
    arithmetic_task("add2_slip", 1.0, partial(slip_prompt, "add", 2)),
)


# Tool requests keep the generator's share of `no_tool` requests (about 9%). A separate, heavier no_tool task taught
# the base to decline by request type ("a timer, but no tool offered can set timers" with set_timer offered: held-out
# set_timer 0.83 -> 0.08 in 10 steps): declining had reward variance, while the right calls were already all right
# (zero variance, no gradient) and nothing held them.
def mini_tasks(phrasings: dict[str, list[str]]) -> TaskMix:
    """The mini recipe's mix, its arithmetic asked in `phrasings` (the base's SFT phrasings plus RL's own)."""
    return TaskMix(
        tasks=(
            arithmetic_task("sub", 1.5, partial(arithmetic_prompt, "sub", None, phrasings=phrasings)),
            arithmetic_task("mul", 1.0, partial(arithmetic_prompt, "mul", None, phrasings=phrasings)),
            arithmetic_task("pct", 0.75, partial(arithmetic_prompt, "pct", None, phrasings=phrasings)),
            arithmetic_task("add2", 0.75, partial(arithmetic_prompt, "add", 2, phrasings=phrasings)),
            Task("tools", 2.0, partial(tool_prompt, None), exact_tool_call),
        ),
        held_out=(
            HeldOut("arithmetic", held_out_arithmetic, evaluate.arithmetic_correct, 160),
            HeldOut("tools", evaluate.tool_cases, evaluate.tool_call_correct, 96),
        ),
    )


def framed_tasks(mix: TaskMix, share: float) -> TaskMix:
    """`mix` with every task's prompts framed by `framed` at `share` (each of prefix and suffix), held-out unchanged."""
    tasks = tuple(replace(t, make=partial(framed_prompt, t.make, share)) for t in mix.tasks)
    return TaskMix(tasks, mix.held_out)


MINI_TASKS = mini_tasks(ARITHMETIC_PHRASINGS)
# The same mix for the base trained on the wider phrasings (run rl19 in the README).
WIDE_TASKS = mini_tasks(WIDE_ARITHMETIC_PHRASINGS)
# rl19's mix with its prompts framed (run rl21 in the README): about half the questions carry a prefix, half a suffix.
FRAMED_WIDE_TASKS = framed_tasks(WIDE_TASKS, 0.5)
# rl19's mix plus add2 and sub asked only in the frames the wide base misreads (run rl23 in the README): RL's mul
# prompts reward reading "{a} and {b}" as a product, and nothing in rl19's mix rewarded reading it as a sum.
READING_WIDE_TASKS = TaskMix(
    tasks=WIDE_TASKS.tasks
    + (
        arithmetic_task("add2_reading", 1.0, partial(arithmetic_prompt, "add", 2, phrasings=READING_RL_TEMPLATES)),
        arithmetic_task("sub_reading", 0.5, partial(arithmetic_prompt, "sub", None, phrasings=READING_RL_TEMPLATES)),
    ),
    held_out=WIDE_TASKS.held_out,
)
# rl23's mix plus mul and sub asked with the operation words the wide base misreads (run rl26 in the README): rl23
# lifted add2's held-out phrasings and lost mul's, whose "multiplied by" no prompt of its asked.
WORDS_WIDE_TASKS = TaskMix(
    tasks=READING_WIDE_TASKS.tasks
    + (
        arithmetic_task("mul_words", 1.0, partial(arithmetic_prompt, "mul", None, phrasings=WORD_RL_TEMPLATES)),
        arithmetic_task("sub_words", 0.5, partial(arithmetic_prompt, "sub", None, phrasings=WORD_RL_TEMPLATES)),
    ),
    held_out=WIDE_TASKS.held_out,
)


# -- a task any random checkpoint can learn: seconds-scale runs of the real loop (tests, smoke runs) ---------------
PARITY_QUESTIONS = ("Say something.", "Go on.", "Tell me more.", "Continue.", "Hello?", "Talk to me.")


def parity_prompt(rng: random.Random) -> Episode:
    return Episode("parity", [{"role": "user", "content": rng.choice(PARITY_QUESTIONS)}])


def mostly_even(ep: Episode, text: str, ids: list[int]) -> float:
    """1.0 when most sampled token ids are even."""
    return float(2 * sum(t % 2 == 0 for t in ids) > len(ids))


def parity_cases(n: int) -> list[tuple[str, Episode]]:
    return [("parity", parity_prompt(random.Random(HELD_OUT_PARITY_SEED + i))) for i in range(n)]


def nonempty(ep: Episode, text: str) -> bool:
    return bool(text)


HELD_OUT_PARITY_SEED = 77_000
PARITY_TASKS = TaskMix(
    tasks=(Task("parity", 1.0, parity_prompt, mostly_even),),
    held_out=(HeldOut("parity", parity_cases, nonempty, 4),),
)
