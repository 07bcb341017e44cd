"""The SFT data generators: deterministic, split cleanly into training and held-out, valid tool calls, sound traces."""

from __future__ import annotations

import collections
import json
import random
import re

import pytest

from kestrel.chat_template import render_chat
from kestrel.train.data import (
    COPY_DRILLS,
    HELD_OUT,
    MINI_MIX,
    RANDOM_COPY_DRILLS,
    TRAIN,
    WIDE_MIX,
    Episode,
    Source,
    episodes,
)
from kestrel.train.evaluate import (
    CATEGORIES,
    PLACE_SLOTS,
    arithmetic_cases,
    copy_scores,
    tool_call_correct,
    tool_calls,
    tool_cases,
)
from kestrel.train.synth import copying
from kestrel.train.synth.arithmetic import (
    CANONICAL,
    HELD_OUT_TEMPLATES,
    TRAIN_TEMPLATES,
    WIDE_TRAIN_TEMPLATES,
    WIDER_TRAIN_TEMPLATES,
    arithmetic_episode,
    solve,
)
from kestrel.train.synth.phrasing import fill, normalized
from kestrel.train.synth.places import REAL_PLACES, place_split
from kestrel.train.synth.tool_schemas import TOOL_DEFS, TOOL_NAMES, tool_schema
from kestrel.train.synth.tool_templates import TEMPLATES
from kestrel.train.synth.tools import NO_TOOL, call_message


@pytest.fixture(scope="module")
def training() -> list[Episode]:
    return episodes(0, 12000)


@pytest.fixture(scope="module")
def held_out() -> list[Episode]:
    """The evaluation's questions plus a held-out stream of the whole mix."""
    return [ep for _, ep in tool_cases(25) + arithmetic_cases(25)] + episodes(1, 1500, split=HELD_OUT)


TOOL_NAMES_FOR = {
    "weather": "get_weather",
    "weather_unit": "get_weather",
    "time": "get_local_time",
    "population": "get_population",
    "directions": "get_directions",
    "directions_mode": "get_directions",
    "units": "convert_units",
    "currency": "convert_currency",
    "search": "search_web",
    "stock": "get_stock_price",
    "email": "send_email",
    "timer": "set_timer",
    "calculator": "calculator",
}


def _rendered(eps: list[Episode]) -> list[str]:
    return [render_chat(ep.messages, ep.tools, False, ep.reasoning_effort) for ep in eps]


def test_episode_stream_is_fixed_by_its_seed():
    a, b, c = episodes(3, 400), episodes(3, 400), episodes(4, 400)
    assert _rendered(a) == _rendered(b) and [e.answer for e in a] == [e.answer for e in b]
    assert _rendered(a) != _rendered(c)
    assert [ep.messages for _, ep in tool_cases(3)] == [ep.messages for _, ep in tool_cases(3)]


def test_mix_draws_each_source_by_weight_and_takes_new_sources():
    extra = Source("echo", 1.0, lambda rng, split: Episode("echo", [{"role": "user", "content": split}]))
    mix = (*MINI_MIX, extra)
    eps = episodes(0, 4000, mix)
    counts = collections.Counter(ep.kind for ep in eps)
    total = sum(s.weight for s in mix)
    for source in mix:
        assert abs(counts[source.name] / len(eps) - source.weight / total) < 0.03, (source.name, counts)
    assert {ep.messages[0]["content"] for ep in eps if ep.kind == "echo"} == {TRAIN}
    with pytest.raises(ValueError, match="split"):
        episodes(0, 1, split="test")
    with pytest.raises(ValueError, match="positive weight"):
        episodes(0, 1, (Source("none", 0.0, extra.make),))


def test_training_covers_every_tool_and_operation(training):
    categories = collections.Counter(ep.meta["category"] for ep in training)
    assert set(CATEGORIES) | {"add", "sub", "mul", "pct", "smalltalk"} <= set(categories)
    intents = {ep.meta.get("intent") for ep in training}
    assert set(TEMPLATES) <= intents


def test_held_out_phrasings_differ_from_every_training_phrasing():
    train = {normalized(t) for ts, _ in TEMPLATES.values() for t in ts}
    train |= {normalized(t) for ts in TRAIN_TEMPLATES.values() for t in ts}
    held = [t for _, hs in TEMPLATES.values() for t in hs] + [t for hs in HELD_OUT_TEMPLATES.values() for t in hs]
    assert held and not {normalized(t) for t in held} & train


def test_wider_phrasings_are_new_and_share_no_frame_with_a_held_out_one():
    """The wider set adds phrasings (none an original training one) and is not the held-out set in other words: no
    held-out phrasing equals one, or lies inside one ("Subtract {b} from {a}." inside "Please subtract ...")."""
    assert set(WIDER_TRAIN_TEMPLATES) == set(TRAIN_TEMPLATES)
    wider = {normalized(t) for ts in WIDER_TRAIN_TEMPLATES.values() for t in ts}
    assert not wider & {normalized(t) for ts in TRAIN_TEMPLATES.values() for t in ts}
    held = {normalized(t) for hs in HELD_OUT_TEMPLATES.values() for t in hs}
    assert not any(h in w or w in h for h in held for w in wider)


def test_wide_mix_asks_the_wider_phrasings_in_training_and_only_held_out_ones_in_held_out():
    train = [ep for ep in episodes(0, 3000, WIDE_MIX) if ep.kind == "arithmetic"]
    assert all(ep.meta["template"] in WIDE_TRAIN_TEMPLATES[ep.meta["op"]] for ep in train)
    used = collections.Counter(ep.meta["template"] for ep in train)
    for op, extra in WIDER_TRAIN_TEMPLATES.items():
        assert sum(used[t] for t in extra) > 0 and sum(used[t] for t in TRAIN_TEMPLATES[op]) > 0
    held = [ep for ep in episodes(1, 600, WIDE_MIX, HELD_OUT) if ep.kind == "arithmetic"]
    assert held and all(ep.meta["template"] in HELD_OUT_TEMPLATES[ep.meta["op"]] for ep in held)
    assert [ep.messages for ep in episodes(0, 50)] != [ep.messages for ep in episodes(0, 50, WIDE_MIX)]


def test_no_held_out_place_template_or_value_appears_in_training(training, held_out):
    # The evaluation also asks unseen operand pairs in the original (training) phrasings: those are not held out.
    canonical = {t for ts in CANONICAL.values() for t in ts}
    train_templates = {ep.meta["template"] for ep in training if "template" in ep.meta}
    held_templates = {ep.meta["template"] for ep in held_out if "template" in ep.meta} - canonical
    assert len(held_templates) > 50 and not train_templates & held_templates

    held_places = {p for ep in held_out for s, p in ep.meta.get("slots", {}).items() if s in PLACE_SLOTS}
    held_places |= {p for p in REAL_PLACES if place_split(p) == HELD_OUT}
    assert "Springfield" in held_places and any(p not in REAL_PLACES for p in held_places)
    # Whole-word matches anywhere in a training conversation: user turns, calls, tool results, replies.
    pattern = re.compile(r"\b(?:" + "|".join(re.escape(p) for p in sorted(held_places, key=len, reverse=True)) + r")\b")
    leaks = [m.group() for text in _rendered(training) for m in [pattern.search(text)] if m]
    assert leaks == []

    # Slots drawn one value at a time; the others (an amount with its units, an expression) are split as a whole.
    single = {"email": ("to", "body"), "search": ("query",), "stock": ("symbol",), "timer": ("minutes",)}

    def values(eps: list[Episode]) -> set[str]:
        slots = [(ep.meta["intent"], ep.meta["slots"]) for ep in eps if ep.meta.get("slots")]
        singles = {f"{k}={v}" for intent, sl in slots for k, v in sl.items() if k in single.get(intent, PLACE_SLOTS)}
        return singles | {intent + json.dumps(sl, sort_keys=True, ensure_ascii=False) for intent, sl in slots}

    shared = values(training) & values(held_out)
    assert not shared, sorted(shared)[:5]
    operands = {(ep.meta["op"], ep.meta["a"], ep.meta["b"]) for ep in training if "op" in ep.meta}
    assert not operands & {(ep.meta["op"], ep.meta["a"], ep.meta["b"]) for ep in held_out if "op" in ep.meta}


def test_tool_schemas_are_valid_and_every_call_parses_and_matches_its_schema(training, held_out):
    import jsonschema

    from kestrel.server.tool_calls import parse_tool_calls

    validators = {}
    for name in TOOL_NAMES:
        schema = tool_schema(name)["function"]["parameters"]
        jsonschema.Draft202012Validator.check_schema(schema)
        validators[name] = jsonschema.Draft202012Validator(schema)
    tool_eps = [ep for ep in training + held_out if ep.kind == "tools"]
    assert len(tool_eps) > 3000
    for ep in tool_eps:
        offered = [t["function"]["name"] for t in ep.tools]
        assert len(set(offered)) == len(offered)
        assistant = [m for m in ep.messages if m["role"] == "assistant"][0]
        text = render_chat([assistant], None, False).removeprefix("<|im_assistant|>assistant<|im_middle|>")
        content, calls = parse_tool_calls(text)
        assert tool_call_correct(ep, text)
        if ep.meta["category"] == NO_TOOL:
            assert calls == [] and content.endswith(assistant["content"] + "<|im_end|>")
            needed = "calculator" if ep.meta["intent"] == "arithmetic" else TOOL_NAMES_FOR[ep.meta["intent"]]
            assert needed not in offered
            continue
        name, args = ep.answer["name"], ep.answer["arguments"]
        assert name in offered and tool_calls(text) == [(name, args)]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [(name, args)]
        assert calls[0]["id"] == f"functions.{name}:0" and ep.messages[2]["tool_call_id"] == calls[0]["id"]
        validators[name].validate(args)
        for slot in PLACE_SLOTS:  # copied verbatim from the user's words
            if slot in args:
                assert args[slot] in ep.messages[0]["content"]


def test_every_intent_maps_to_a_declared_tool():
    assert set(TOOL_NAMES_FOR) == set(TEMPLATES) and set(TOOL_NAMES_FOR.values()) == set(TOOL_DEFS)


_FACTS = [
    (re.compile(r"(\d+)\+(\d+)\+(\d+)=(\d+)"), lambda x, y, c, s: x + y + c == s),
    (re.compile(r"(?<![\d+])(\d+)\+(\d+)=(\d+)"), lambda x, y, s: x + y == s),
    (re.compile(r"(?<![\d<])(\d+)-(\d+)=(\d+)"), lambda x, y, d: x - y == d),
    (re.compile(r"(\d+)<(\d+) so 1(\d)-(\d+)=(\d+)"), lambda x, t, x2, t2, d: x < t and x == x2 and 10 + x - t == d),
    (re.compile(r"(\d+)x(\d+)=(\d+)"), lambda x, d, p: x * d == p),
    (re.compile(r"10% of (\d+) is (\d+)(?! /)"), lambda n, t: n // 10 == t),
    (re.compile(r"(\d+) / 10 = (\d+)"), lambda n, t: n // 10 == t),
    (re.compile(r"half of (\d+) is (\d+)"), lambda n, h: n // 2 == h),
    (re.compile(r"(\d+)/2=(\d+)( r1)?"), None),
]


def test_every_step_of_every_trace_is_a_true_fact():
    """Traces are chains of one-digit facts; a wrong fact would teach a wrong table."""
    rng = random.Random(5)
    for _ in range(3000):
        ep = arithmetic_episode(rng, rng.choice([TRAIN, HELD_OUT]), effort="high")
        trace, answer = solve(ep.meta["op"], ep.meta["a"], ep.meta["b"])
        assert ep.messages[1]["reasoning_content"] == trace and ep.messages[1]["content"] == f"The answer is {answer}."
        assert trace.endswith(f"= {answer}.") or trace.endswith(f"is {answer}.")
        checked = 0
        for pattern, holds in _FACTS:
            for m in pattern.finditer(trace):
                nums = [int(g) for g in m.groups() if g and g.strip() != "r1"]
                if holds is None:
                    v, q = nums
                    assert v // 2 == q and (v % 2 == 1) == bool(m.group(3)), m.group()
                else:
                    assert holds(*nums), m.group()
                checked += 1
        assert checked or ep.meta["op"] == "pct"


def test_noise_leaves_slot_values_intact():
    rng = random.Random(0)
    for _ in range(300):
        text = fill("Could you check the weather in {city} for me?", {"city": "São Paulo"}, rng, noise=1.0)
        assert "São Paulo" in text and text == text.lower().replace("são paulo", "São Paulo")
    assert fill("What is {a} + {b}?", {"a": 1, "b": 2}) == "What is 1 + 2?"


def test_every_category_of_the_evaluation_has_n_questions_from_held_out_phrasings():
    cases = tool_cases(6)
    assert collections.Counter(k for k, _ in cases) == dict.fromkeys(CATEGORIES, 6)
    held = {t for _, hs in TEMPLATES.values() for t in hs} | {t for hs in HELD_OUT_TEMPLATES.values() for t in hs}
    assert all(ep.meta["template"] in held for _, ep in cases if ep.meta.get("intent") != "arithmetic")
    arith = arithmetic_cases(5)
    assert collections.Counter(k for k, _ in arith) == {
        k: 5 for op in ("add2", "sub", "mul", "pct") for k in (op, f"{op}_paraphrased")
    }
    assert all(ep.meta["a"] + ep.meta["b"] < 200 for k, ep in arith if k.startswith("add2"))
    # The expected call scores; one changed argument, an extra call or no call does not.
    for _, ep in cases:
        if ep.meta["category"] == NO_TOOL:
            assert tool_call_correct(ep, "Sorry.") and not tool_call_correct(ep, _call_text("get_weather", {}))
            continue
        name, args = ep.answer["name"], ep.answer["arguments"]
        key, value = next(iter(args.items()))
        wrong = {**args, key: value + ("x" if isinstance(value, str) else 1)}
        assert tool_call_correct(ep, _call_text(name, args))
        assert not tool_call_correct(ep, _call_text(name, wrong))
        assert not tool_call_correct(ep, _call_text(name, args) + _call_text(name, args))
        assert not tool_call_correct(ep, "The answer is 3.")


def _call_text(name: str, args: dict) -> str:
    return render_chat([call_message(name, args, "")], None, False)


def test_copy_drills_reply_with_the_verbatim_span_and_keep_the_train_held_out_split():
    train, held = episodes(2, 800, (COPY_DRILLS,)), episodes(3, 400, (COPY_DRILLS,), HELD_OUT)
    assert COPY_DRILLS not in MINI_MIX  # opt-in: no A/B has shown it lifts held-out tool calls yet
    for ep in train + held:
        span = ep.meta["slots"]["text"]
        assert ep.kind == "copy" and ep.answer == span and span in ep.messages[0]["content"]
        assert ep.messages[1]["content"] == span  # the reply is the span itself, nothing around it
    assert {ep.meta["tool"] for ep in train} == set(copying.SPAN_SLOTS)

    def spans(eps: list[Episode]) -> set[str]:
        return {ep.meta["slots"]["text"] for ep in eps}

    assert len(spans(held)) > 200 and not spans(train) & spans(held)

    def cities(eps: list[Episode]) -> set[str]:
        return {ep.meta["slots"]["text"] for ep in eps if ep.meta["tool"] == "get_weather"}

    assert {place_split(p) for p in cities(train)} == {TRAIN} and {place_split(p) for p in cities(held)} == {HELD_OUT}
    train_templates, held_templates = copying.TEMPLATES
    assert {ep.meta["template"] for ep in train} <= set(train_templates)
    assert {ep.meta["template"] for ep in held} <= set(held_templates)
    assert not {normalized(t) for t in train_templates} & {normalized(t) for t in held_templates}
    # No held-out place, whole word, anywhere in a training drill.
    held_places = {p for p in REAL_PLACES if place_split(p) == HELD_OUT} | cities(held)
    pattern = re.compile(r"\b(?:" + "|".join(re.escape(p) for p in sorted(held_places, key=len, reverse=True)) + r")\b")
    assert [m.group() for text in _rendered(train) for m in [pattern.search(text)] if m] == []


def test_random_span_drills_use_fresh_pseudo_words_and_split_their_phrasings():
    train, held = episodes(4, 2000, (RANDOM_COPY_DRILLS,)), episodes(5, 500, (RANDOM_COPY_DRILLS,), HELD_OUT)
    assert RANDOM_COPY_DRILLS not in MINI_MIX  # a probe of the skill, not part of the embedded model's data
    for ep in train + held:
        span = ep.answer
        words = span.split(" ")
        assert 1 <= len(words) <= 3 and all(w.isalpha() for w in words)
        assert span in ep.messages[0]["content"] and ep.messages[1]["content"] == span
        assert ep.messages[1]["reasoning_content"] == f"The user wants {span} repeated."
    # Nothing to memorise: spans practically never repeat, within or across the splits.
    spans = [ep.answer for ep in train + held]
    assert len(set(spans)) >= 0.99 * len(spans)
    train_templates, held_templates = copying.TEMPLATES
    assert {ep.meta["template"] for ep in train} == set(train_templates)
    assert {ep.meta["template"] for ep in held} == set(held_templates)


def test_copy_scores_count_exact_replies_and_reasoning_repeats():
    cases = episodes(6, 4, (RANDOM_COPY_DRILLS,), HELD_OUT)
    span = [ep.answer for ep in cases]
    outputs = [
        f"<think>The user wants {span[0]} repeated.</think>{span[0]}",  # both right
        f"<think>The user wants {span[1]} repeated.</think>{span[1]}x",  # reply has an extra letter
        f"<think>The user wants {span[2]}s repeated.</think> {span[2]} ",  # reply right (whitespace), reasoning wrong
        f"<think>The user wants {span[0]} repeated.</think>{span[0]}",  # another case's span
    ]
    assert copy_scores(cases, outputs) == {"copy_random": 0.5, "copy_random:in_reasoning": 0.5}
