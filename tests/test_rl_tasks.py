"""What GRPO trains on: the rewards through the evaluation's parsers, the prompts each task draws (training
operands and phrasings only, never a held-out one, framed or not) and the RL recipes' mixes and settings."""

from __future__ import annotations

import collections
import dataclasses
import json
import pickle
import random
import re
from pathlib import Path

from tokenizers import Tokenizer

from kestrel.chat_template import render_tool_calls
from kestrel.models.builtin import TIED_DIR
from kestrel.train.recipes import RL_RECIPES
from kestrel.train.rl import check_config
from kestrel.train.rl_tasks import (
    FRAMED_WIDE_TASKS,
    MINI_TASKS,
    READING_WIDE_TASKS,
    SLIP_TASKS,
    TOOL_PHRASINGS,
    WIDE_ARITHMETIC_PHRASINGS,
    WIDE_TASKS,
    WORDS_WIDE_TASKS,
    TaskMix,
    calls_for_a_slipping_step,
    framed_prompt,
)
from kestrel.train.synth.arithmetic import (
    HELD_OUT_TEMPLATES,
    TRAIN_TEMPLATES,
    WIDE_TRAIN_TEMPLATES,
    arithmetic_episode,
    solve,
)
from kestrel.train.synth.episode import TRAIN, split_of
from kestrel.train.synth.phrasing import normalized
from kestrel.train.synth.places import place_split
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


def assert_pickles(mix: TaskMix, tok: Tokenizer, n: int) -> None:
    """The mix crosses a process boundary (spawned ranks unpickle it) and draws the same prompts there."""
    again = pickle.loads(pickle.dumps(mix))
    drawn = [p.ids for p in mix.sample(random.Random(5), n, tok)]
    assert [p.ids for p in again.sample(random.Random(5), n, tok)] == drawn


def own_phrasing_draws(mix: TaskMix, suffix: str, templates: dict[str, list[str]], tok: Tokenizer, seed: int):
    """Sample 500 prompts: the tasks named `*suffix` ask only `templates` (of their operation) in training operands,
    the others never ask them. Returns the prompts and the phrasings each such task drew."""
    own = {t for ts in templates.values() for t in ts}
    seen: dict[str, set[str]] = collections.defaultdict(set)
    prompts = mix.sample(random.Random(seed), 500, tok)
    for p in prompts:
        meta = p.episode.meta
        if p.task.endswith(suffix):
            assert meta["template"] in templates[meta["op"]]
            assert split_of(f"{meta['op']}:{meta['a']}:{meta['b']}") == TRAIN
            seen[p.task].add(meta["template"])
        elif "template" in meta:
            assert meta["template"] not in own
    return prompts, seen


def test_rewards_are_exact_final_answers_and_exact_tool_calls():
    rng = random.Random(5)
    sub, tools = MINI_TASKS.task("sub"), MINI_TASKS.task("tools")
    ep = arithmetic_episode(rng, TRAIN, "sub")
    assert sub.reward(ep, f"<think>... So it is {ep.answer + 1}.</think>The answer is {ep.answer}.", []) == 1.0
    assert sub.reward(ep, f"<think>So {ep.answer}.</think>The answer is {ep.answer + 1}.", []) == 0.0
    assert sub.reward(ep, "<think>hmm</think>I do not know.", []) == 0.0
    ep = tool_episode(rng, TRAIN, "get_weather")
    args = ep.answer["arguments"]
    city = args["city"]

    def call(name, args):
        return {"function": {"name": name, "arguments": json.dumps(args)}}

    right = render_tool_calls([call("get_weather", args)])
    assert tools.reward(ep, "<think>x</think>" + right, []) == 1.0
    other = args | {"city": city + "ville"}
    assert tools.reward(ep, render_tool_calls([call("get_weather", other)]), []) == 0.0
    assert tools.reward(ep, render_tool_calls([call("get_local_time", args)]), []) == 0.0
    twice = render_tool_calls([call("get_weather", args)] * 2)
    assert tools.reward(ep, twice, []) == 0.0
    assert tools.reward(ep, right.replace("}<|tool_call_end|>", "<|tool_call_end|>"), []) == 0.0  # not JSON


def test_slip_tasks_ask_only_operands_whose_trace_has_the_slipping_step():
    """Read off each worked trace: a mul carry addition whose sum crosses a ten (`45+6=51`), a sub column with equal
    digits (`2-2=0`) or a borrow, an add column with a carry coming in (`3+3+1=7`). The slip tasks ask only such
    questions, in the training split; the plain tasks also ask others."""
    crossing = re.compile(r"(\d+)\+(\d+)=(\d+)")
    equal_or_borrow = re.compile(r"\b(\d)-\1=0\.|borrow 1")
    carry_in = re.compile(r"\b\d\+\d\+1=")

    def trace_has_slipping_step(op: str, a: int, b: int) -> bool:
        trace = solve(op, a, b)[0].split(" So ")[0]
        if op == "mul":
            return any(int(p) // 10 != int(s) // 10 for p, _, s in crossing.findall(trace))
        if op == "add":
            return bool(carry_in.search(trace))
        return bool(equal_or_borrow.search(trace))

    rng = random.Random(11)
    for op, name in (("mul", "mul"), ("sub", "sub"), ("add", "add2")):
        plain, slip = MINI_TASKS.task(name), next(t for t in SLIP_TASKS if t.name == f"{name}_slip")
        for task, expect_only_slips in ((slip, True), (plain, False)):
            has = []
            for _ in range(300):
                meta = task.make(rng).meta
                assert meta["op"] == op and split_of(f"{op}:{meta['a']}:{meta['b']}") == TRAIN
                assert calls_for_a_slipping_step(op, meta["a"], meta["b"]) == trace_has_slipping_step(
                    op, meta["a"], meta["b"]
                )
                has.append(calls_for_a_slipping_step(op, meta["a"], meta["b"]))
            assert all(has) if expect_only_slips else 0 < sum(has) < len(has)


def test_rl_prompts_never_use_a_held_out_phrasing_or_slot_value():
    """RL asks training slot values in the SFT phrasings and its own; its own are new to SFT and to the evaluation."""
    sft = {normalized(t) for ts, _ in TOOL_TEMPLATES.values() for t in ts}
    sft |= {normalized(t) for ts in WIDE_TRAIN_TEMPLATES.values() for t in ts}
    held = {normalized(t) for _, hs in TOOL_TEMPLATES.values() for t in hs}
    held |= {normalized(t) for hs in HELD_OUT_TEMPLATES.values() for t in hs}
    rl = [t for ts in TOOL_RL_TEMPLATES.values() for t in ts]
    own = (ARITHMETIC_RL_TEMPLATES, READING_RL_TEMPLATES, WORD_RL_TEMPLATES)
    rl += [t for templates in own for ts in templates.values() for t in ts]
    assert set(TOOL_RL_TEMPLATES) == set(TOOL_TEMPLATES) and set(ARITHMETIC_RL_TEMPLATES) == set(TRAIN_TEMPLATES)
    assert not {normalized(t) for t in rl} & (sft | held)  # (units and currencies share a phrasing, as in SFT)

    prompts = MINI_TASKS.sample(random.Random(3), 600, Tokenizer.from_file(str(TIED_DIR / "tokenizer.json")))
    used = {p.episode.meta["template"] for p in prompts if "template" in p.episode.meta}
    assert {p.task for p in prompts} == {t.name for t in MINI_TASKS.tasks}
    for rl_set, sft_set in (
        (TOOL_RL_TEMPLATES, {i: t for i, (t, _) in TOOL_TEMPLATES.items()}),
        (ARITHMETIC_RL_TEMPLATES, WIDE_TRAIN_TEMPLATES),
    ):
        assert used & {t for ts in rl_set.values() for t in ts} and used & {t for ts in sft_set.values() for t in ts}
    assert not {normalized(t) for t in used} & held
    for p in prompts:
        meta = p.episode.meta
        if "op" in meta:
            assert split_of(f"{meta['op']}:{meta['a']}:{meta['b']}") == TRAIN
        places = [meta["slots"][s] for s in ("city", "origin", "destination") if s in meta.get("slots", {})]
        assert all(place_split(v) == TRAIN for v in places)


def test_no_frame_turns_a_training_phrasing_into_a_held_out_one():
    """Every framed phrasing RL can ask (any prefix or none, any suffix or none) neither equals nor contains a
    held-out phrasing, after normalisation: framing adds RL's own words, never the evaluation's."""
    held = {normalized(t) for _, hs in TOOL_TEMPLATES.values() for t in hs}
    held |= {normalized(t) for hs in HELD_OUT_TEMPLATES.values() for t in hs}
    phrasings = [t for ts in (*WIDE_ARITHMETIC_PHRASINGS.values(), *TOOL_PHRASINGS.values()) for t in ts]
    framed = {normalized(p + t + s) for t in phrasings for p in ("", *FRAME_PREFIXES) for s in ("", *FRAME_SUFFIXES)}
    assert len(framed) > len(phrasings) * len(FRAME_PREFIXES)
    assert not [(f, h) for f in framed for h in held if h in f]


def test_reading_and_word_phrasings_are_no_held_out_phrasing_nor_near_one():
    """The phrasings rl23 and rl26 ask in the frames and words the wide base misreads neither contain a held-out
    phrasing, nor differ from one by a single word (a swapped verb would teach the test's own sentence), nor end as one
    does from its first slot on (the test's question with another opening)."""
    held = [normalized(t).split() for hs in HELD_OUT_TEMPLATES.values() for t in hs]
    tails = [h[min(h.index("{a}"), h.index("{b}")) :] for h in held]
    for op, t in [(op, t) for d in (READING_RL_TEMPLATES, WORD_RL_TEMPLATES) for op, ts in d.items() for t in ts]:
        words = normalized(t).split()
        assert {"{a}", "{b}"} <= set(words) and op in ARITHMETIC_RL_TEMPLATES
        assert not [h for h in held if " ".join(h) in " ".join(words)]
        one_word_away = [h for h in held if len(h) == len(words) and sum(x != y for x, y in zip(h, words)) <= 1]
        assert not one_word_away, (t, one_word_away)
        assert not [tail for tail in tails if words[-len(tail) :] == tail], t


def test_framed_prompts_ask_the_same_question_inside_a_frame_about_half_the_time():
    frames = collections.Counter()
    for i in range(240):
        task = WIDE_TASKS.tasks[i % len(WIDE_TASKS.tasks)]
        bare = task.make(random.Random(i))
        framed = framed_prompt(task.make, 0.5, random.Random(i))  # the same draws, then the frame's
        prefix, suffix = framed.meta["frame"]
        assert framed.messages[0]["content"] == prefix + bare.messages[0]["content"] + suffix
        assert framed.answer == bare.answer and framed.messages[1:] == bare.messages[1:]
        assert prefix in ("", *FRAME_PREFIXES) and suffix in ("", *FRAME_SUFFIXES)
        frames[(bool(prefix), bool(suffix))] += 1
    assert set(frames) == {(False, False), (True, False), (False, True), (True, True)}
    assert 0.35 < sum(n for (p, _), n in frames.items() if p) / 240 < 0.65
    # The framed mix has the wide mix's tasks and weights, and crosses a process boundary (spawned ranks unpickle it).
    assert [(t.name, t.weight) for t in FRAMED_WIDE_TASKS.tasks] == [(t.name, t.weight) for t in WIDE_TASKS.tasks]
    assert_pickles(FRAMED_WIDE_TASKS, Tokenizer.from_file(str(TIED_DIR / "tokenizer.json")), 20)


# -- the recipes ------------------------------------------------------------------------------------------------------
def test_the_mini_recipe_adapts_the_tied_candidate_within_its_budget():
    """The shipped recipe's base is the tied retrain (its calls can earn a reward), named by its asset folder."""
    mini = RL_RECIPES["mini"]
    assert Path(mini.model) == TIED_DIR and (TIED_DIR / "tokenizer.json").exists()
    assert mini.config.max_minutes <= 40 and mini.config.deterministic
    check_config(mini.config)


def test_the_wide_recipe_asks_the_mini_mix_in_its_base_s_wider_phrasings_too():
    """`mini-wide` is `mini` on the base trained on the wider phrasings: the same tasks, weights and settings, its
    arithmetic also asked in those phrasings, which `mini` never asks (its base never read them)."""
    from kestrel.train.synth.arithmetic import WIDER_TRAIN_TEMPLATES

    mini, wide = RL_RECIPES["mini"], RL_RECIPES["mini-wide"]
    assert wide.config == mini.config and wide.tasks is WIDE_TASKS
    assert [(t.name, t.weight) for t in wide.tasks.tasks] == [(t.name, t.weight) for t in mini.tasks.tasks]
    tok = Tokenizer.from_file(str(TIED_DIR / "tokenizer.json"))
    wider = {t for ts in WIDER_TRAIN_TEMPLATES.values() for t in ts}

    def templates(mix: TaskMix) -> set[str]:
        return {p.episode.meta["template"] for p in mix.sample(random.Random(4), 400, tok) if "op" in p.episode.meta}

    assert templates(WIDE_TASKS) & wider and not templates(MINI_TASKS) & wider
    framed = RL_RECIPES["mini-wide-framed"]  # run rl21: the same run, its prompts framed
    assert framed.config == wide.config and framed.model == wide.model and framed.tasks is FRAMED_WIDE_TASKS


def test_the_reading_recipe_is_the_anchored_wide_run_plus_questions_in_misread_frames():
    """`mini-wide-reading` (run rl23) is rl22: the wide mix at a KL of 1.0 that also holds half the zero-variance
    groups, plus add2 and sub asked only in the reading phrasings, in training operands."""
    wide, reading = RL_RECIPES["mini-wide"], RL_RECIPES["mini-wide-reading"]
    assert reading.model == wide.model and reading.tasks is READING_WIDE_TASKS
    assert reading.config.kl_anchor_share == 0.5 and reading.config.clip.kl_coef == 1.0
    assert dataclasses.replace(reading.config, kl_anchor_share=0.0, clip=wide.config.clip) == wide.config
    assert wide.config.kl_anchor_share == 0.0 and wide.config.clip.kl_coef == 0.1  # the edit made a copy
    check_config(reading.config)
    assert READING_WIDE_TASKS.tasks[: len(WIDE_TASKS.tasks)] == WIDE_TASKS.tasks
    assert READING_WIDE_TASKS.held_out == WIDE_TASKS.held_out
    tok = Tokenizer.from_file(str(TIED_DIR / "tokenizer.json"))
    # The wide tasks ask as rl19 and rl22 did; add2_reading asks 2-digit sums.
    prompts, seen = own_phrasing_draws(READING_WIDE_TASKS, "_reading", READING_RL_TEMPLATES, tok, seed=6)
    for meta in [p.episode.meta for p in prompts if p.task == "add2_reading"]:
        assert 10 <= meta["a"] <= 99 and 10 <= meta["b"] <= 99
    assert seen == {"add2_reading": set(READING_RL_TEMPLATES["add"]), "sub_reading": set(READING_RL_TEMPLATES["sub"])}
    assert_pickles(READING_WIDE_TASKS, tok, 30)


def test_the_words_recipe_is_the_reading_run_plus_mul_and_sub_in_misread_words():
    """`mini-wide-words` (run rl26) is rl23's run plus mul and sub asked only in `WORD_RL_TEMPLATES`, in training
    operands; rl23's tasks never ask those phrasings."""
    reading, words = RL_RECIPES["mini-wide-reading"], RL_RECIPES["mini-wide-words"]
    assert words.model == reading.model and words.config == reading.config and words.tasks is WORDS_WIDE_TASKS
    assert WORDS_WIDE_TASKS.tasks[: len(READING_WIDE_TASKS.tasks)] == READING_WIDE_TASKS.tasks
    assert WORDS_WIDE_TASKS.held_out == READING_WIDE_TASKS.held_out
    tok = Tokenizer.from_file(str(TIED_DIR / "tokenizer.json"))
    prompts, seen = own_phrasing_draws(WORDS_WIDE_TASKS, "_words", WORD_RL_TEMPLATES, tok, seed=7)
    assert all(p.episode.meta["op"] == p.task.removesuffix("_words") for p in prompts if p.task.endswith("_words"))
    assert seen == {f"{op}_words": set(ts) for op, ts in WORD_RL_TEMPLATES.items()}
    assert_pickles(WORDS_WIDE_TASKS, tok, 30)
