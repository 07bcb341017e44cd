"""Reasoning and Kimi K2 tool-call parsers: streamed in any chunking they equal the whole-text parse."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.chat_template import (
    CALL_ARGS,
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    THINK_BEGIN,
    THINK_END,
    render_tool_calls,
)
from kestrel.server.chat import ChatOutputParser, parse_chat_output
from kestrel.server.reasoning import ReasoningParser, split_reasoning
from kestrel.server.tool_calls import ToolCallParser, merge_tool_calls, parse_tool_calls

WEATHER = f'{CALLS_BEGIN}{CALL_BEGIN}functions.get_weather:0{CALL_ARGS}{{"city": "Beijing"}}{CALL_END}{CALLS_END}'
MODEL_OUTPUT = (
    f"{THINK_BEGIN}The user wants the weather; call the tool.{THINK_END}Let me check."
    f'{CALLS_BEGIN}{CALL_BEGIN}functions.get_weather:0{CALL_ARGS}{{"city": "Beijing"}}{CALL_END}\n'
    f'{CALL_BEGIN}functions.get_time:1{CALL_ARGS}{{"tz": "Asia/Shanghai", "fmt": "<|x|>"}}{CALL_END}'
    f"{CALLS_END}"
)


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def _stream_reasoning(chunks: list[str], think_open: bool = False) -> tuple[str, str]:
    parser = ReasoningParser(think_open)
    parts = [parser.feed(c) for c in chunks] + [parser.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def _stream_tools(chunks: list[str]):
    parser = ToolCallParser()
    content, deltas = [], []
    for c in chunks:
        text, calls = parser.feed(c)
        content.append(text)
        deltas += calls
    text, calls = parser.finish()
    return "".join(content) + text, deltas + calls


# -- reasoning ---------------------------------------------------------------------------------------------
def test_think_section_is_reasoning_and_the_rest_is_content():
    assert split_reasoning(f"{THINK_BEGIN}plan it{THINK_END}\n\nThe answer.") == ("plan it", "\n\nThe answer.")


def test_prompt_that_opened_think_makes_leading_text_reasoning():
    assert split_reasoning(f"plan it{THINK_END}answer", think_open=True) == ("plan it", "answer")
    assert split_reasoning(f"plan it{THINK_END}answer", think_open=False) == ("", f"plan it{THINK_END}answer")


def test_unclosed_think_stays_reasoning_and_text_without_markers_is_content():
    assert split_reasoning(f"{THINK_BEGIN}cut off mid-thou") == ("cut off mid-thou", "")
    assert split_reasoning("just an answer") == ("", "just an answer")
    assert split_reasoning("a <thin") == ("", "a <thin")  # a partial marker at the end is plain text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=12), st.booleans())
def test_reasoning_split_does_not_depend_on_chunking(cuts, think_open):
    text = f"x{THINK_BEGIN}a</thi<nk>{THINK_END}b{THINK_BEGIN}c{THINK_END}d <think"
    assert _stream_reasoning(_chunks(text, cuts), think_open) == split_reasoning(text, think_open)


# -- tool calls --------------------------------------------------------------------------------------------
def test_kimi_k2_section_becomes_openai_tool_calls():
    content, calls = parse_tool_calls("Checking." + WEATHER)
    assert content == "Checking."
    assert calls == [
        {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Beijing"}'},
        }
    ]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Beijing"}


def test_template_rendered_calls_parse_back_to_the_same_calls():
    calls = [
        {"id": "functions.a:0", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
        {"id": "functions.b_c:1", "type": "function", "function": {"name": "b_c", "arguments": "{}"}},
    ]
    assert parse_tool_calls("hi" + render_tool_calls(calls)) == ("hi", calls)


def test_stream_announces_each_call_then_streams_its_arguments():
    _, deltas = _stream_tools(_chunks(WEATHER, list(range(0, len(WEATHER), 3))))
    head, *args = deltas
    assert (head.index, head.id, head.name, head.arguments) == (0, "functions.get_weather:0", "get_weather", "")
    assert len(args) > 1 and all(d.id is None and d.index == 0 for d in args)
    assert "".join(d.arguments for d in args) == '{"city": "Beijing"}'
    assert head.to_openai() == {
        "index": 0,
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=20), st.integers(0, 10_000))
def test_tool_calls_in_any_chunking_and_any_truncation_equal_the_whole_text_parse(cuts, cut_at):
    text = ("Let me check." + MODEL_OUTPUT.split(THINK_END)[1])[: cut_at % (len(MODEL_OUTPUT) + 1)]
    content, deltas = _stream_tools(_chunks(text, cuts))
    assert (content, merge_tool_calls(deltas)) == parse_tool_calls(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=20))
def test_reasoning_plus_tool_calls_stream_equals_non_stream(cuts):
    parser = ChatOutputParser(reasoning=True, tools=True)
    parts = [parser.feed(c) for c in _chunks(MODEL_OUTPUT, cuts)] + [parser.finish()]
    whole = parse_chat_output(MODEL_OUTPUT, reasoning=True, tools=True)
    assert "".join(p.reasoning for p in parts) == whole.reasoning == "The user wants the weather; call the tool."
    assert "".join(p.content for p in parts) == whole.content == "Let me check."
    calls = merge_tool_calls([d for p in parts for d in p.tool_calls])
    assert calls == merge_tool_calls(whole.tool_calls)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"tz": "Asia/Shanghai", "fmt": "<|x|>"}


@pytest.mark.parametrize(
    "text",
    [
        f"a{CALLS_BEGIN}",  # section cut off at once
        f"a{CALLS_BEGIN}{CALL_BEGIN}functions.get_wea",  # cut off inside the id
        f"a{CALLS_BEGIN}junk{CALL_BEGIN}functions.f:0{CALL_ARGS}{{}}{CALL_END}{CALLS_END}",  # text inside section
        f"a{CALLS_BEGIN}{CALL_BEGIN}not a valid id{CALL_ARGS}{{}}{CALL_END}{CALLS_END}",  # bad id
        f"a{CALLS_BEGIN}{CALL_BEGIN}{CALL_ARGS}{{}}{CALL_END}",  # empty id
        f"a{CALLS_BEGIN}{CALL_BEGIN}f{CALL_END}",  # no arguments marker
        f"a{CALLS_BEGIN}{CALL_BEGIN}" + "x" * 400,  # an id that never ends
    ],
)
def test_malformed_or_truncated_section_before_a_call_degrades_to_content(text):
    content, calls = parse_tool_calls(text)
    assert calls == []
    assert content == text


def test_call_cut_off_inside_arguments_stays_a_call_with_the_arguments_so_far():
    text = f'{CALLS_BEGIN}{CALL_BEGIN}functions.f:0{CALL_ARGS}{{"a": [1, 2'
    content, calls = parse_tool_calls(text)
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": '{"a": [1, 2'}


def test_stray_text_after_a_call_is_content_and_earlier_calls_survive():
    text = f"{CALLS_BEGIN}{CALL_BEGIN}functions.f:0{CALL_ARGS}{{}}{CALL_END} oops{CALLS_END}"
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["f"]
    assert content == f" oops{CALLS_END}"


def test_missing_call_end_is_forgiven_at_the_next_marker():
    text = f"{CALLS_BEGIN}{CALL_BEGIN}functions.f:0{CALL_ARGS}{{}}{CALL_BEGIN}functions.g:1{CALL_ARGS}[]{CALLS_END}!"
    content, calls = parse_tool_calls(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", "{}"), ("g", "[]")]
    assert content == "!"


def test_ids_not_in_kimi_form_are_rewritten_with_the_call_index():
    _, calls = parse_tool_calls(f"{CALLS_BEGIN}{CALL_BEGIN}lookup{CALL_ARGS}{{}}{CALL_END}{CALLS_END}")
    assert calls[0]["id"] == "functions.lookup:0" and calls[0]["function"]["name"] == "lookup"


def test_non_finite_logprobs_reach_openai_clients_as_the_floor_not_an_encoding_error():
    from tokenizers import Tokenizer

    from kestrel.models.builtin import EMBEDDED_DIR
    from kestrel.server.chat import chat_logprobs
    from kestrel.server.completions import completion_logprobs
    from kestrel.server.serving import LOGPROB_FLOOR, TokenText

    text_of = TokenText(Tokenizer.from_file(str(EMBEDDED_DIR / "tokenizer.json")))
    ids, lps, top = [5, 6, 7], [-0.5, float("-inf"), float("nan")], [[(5, -0.5), (9, float("-inf"))]] * 3
    chat = json.loads(json.dumps(chat_logprobs(ids, lps, top, text_of), allow_nan=False))  # as JSONResponse encodes
    assert [e["logprob"] for e in chat["content"]] == [-0.5, LOGPROB_FLOOR, LOGPROB_FLOOR]
    assert [a["logprob"] for a in chat["content"][0]["top_logprobs"]] == [-0.5, LOGPROB_FLOOR]
    legacy = json.loads(json.dumps(completion_logprobs(ids, lps, top, text_of), allow_nan=False))
    assert legacy["token_logprobs"] == [-0.5, LOGPROB_FLOOR, LOGPROB_FLOOR]
    assert sorted(legacy["top_logprobs"][0].values()) == [LOGPROB_FLOOR, -0.5]
