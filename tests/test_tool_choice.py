"""`tool_choice`: "required" and a named function are enforced by a grammar, "none" bans the tool-call markers;
bad tools / tool_choice are 400s."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import running_server

# maxLength: off-topic, kestrel-mini would otherwise write an argument string until max_tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 24}},
            "required": ["timezone"],
        },
    },
}
PROMPTS = ["What's the weather in Beijing?", "What is 15% of 240?", "Tell me a joke about cats."]
JSON_OBJECT = {"type": "json_object"}
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def http():
    with running_server(None) as (url, _), httpx.Client(base_url=url, timeout=120) as client:
        yield client


def chat(http: httpx.Client, prompt: str, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 128, **body}
    return http.post("/v1/chat/completions", json=body)


def calls_of(resp: httpx.Response) -> list[tuple[str, dict]]:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_named_tool_choice_calls_exactly_that_function_with_schema_arguments(http, prompt):
    # get_time is never what kestrel-mini would call unprompted: the grammar alone picks it.
    ((name, args),) = calls_of(chat(http, prompt, tools=[WEATHER, TIME], tool_choice=NAMED_TIME))
    assert name == "get_time" and isinstance(args.get("timezone"), str)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_required_tool_choice_calls_only_declared_tools(http, prompt):
    calls = calls_of(chat(http, prompt, tools=[WEATHER, TIME], tool_choice="required"))
    assert calls
    for name, args in calls:
        required = {"get_weather": "city", "get_time": "timezone"}[name]
        assert isinstance(args.get(required), str)


def test_required_tool_choice_holds_when_streaming(http):
    body = {"messages": [{"role": "user", "content": PROMPTS[2]}], "temperature": 0, "max_tokens": 128}
    body |= {"tools": [TIME], "tool_choice": "required", "stream": True}
    names, finish = [], None
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                names += [t["function"]["name"] for t in c["delta"].get("tool_calls") or [] if "id" in t]
                finish = c.get("finish_reason") or finish
    assert names and set(names) == {"get_time"} and finish == "tool_calls"


def test_auto_tool_choice_is_unconstrained(http):
    # Asked about weather with only get_time declared, the model does not call it on its own.
    resp = chat(http, PROMPTS[0], tools=[TIME], tool_choice="auto")
    assert resp.status_code == 200
    assert not any(
        c["function"]["name"] == "get_time" for c in resp.json()["choices"][0]["message"].get("tool_calls") or []
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": NAMED_TIME}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": NAMED_TIME}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "get weather!"}}]}, "tools[0].function.name"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "objekt"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_tools_or_tool_choice_is_a_400_naming_the_field(http, body, param):
    resp = chat(http, "hi", **body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_tool_call_grammar_takes_markers_as_single_tokens_and_only_declared_names():
    from pathlib import Path

    import xgrammar as xgr
    from tokenizers import Tokenizer

    import kestrel
    from kestrel.engine.grammar import GrammarBackend

    tok = Tokenizer.from_file(str(Path(kestrel.__file__).parent / "assets" / "kestrel-mini" / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    backend = GrammarBackend(tok, tok.get_vocab_size(), [eos])
    call = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
    weather, time = (
        call.format("get_weather", 0, '{"city": "Paris"}'),
        call.format("get_time", 1, '{"timezone": "UTC"}'),
    )

    def accepts(grammar, text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        ids = tok.encode(text, add_special_tokens=False).ids + [eos]
        return all(matcher.accept_token(t) for t in ids)

    section = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>".format
    required = backend.compile_tool_calls([WEATHER, TIME])
    assert accepts(required, section(weather + time))
    assert not accepts(required, section(""))  # at least one call
    assert not accepts(required, section(weather.replace("get_weather", "get_wind")))
    assert not accepts(required, section(weather.replace("city", "town")))  # the schema's required key
    named = backend.compile_tool_calls([TIME], parallel=False)
    assert accepts(named, section(time)) and not accepts(named, section(time + time))
    # The section marker as characters, not as its token, is rejected.
    assert not xgr.GrammarMatcher(named).accept_token(tok.encode("<", add_special_tokens=False).ids[0])


MARKERS = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
WEATHER_PROMPT = "What is the weather in Beijing?"


def section_begin_id() -> int:
    from pathlib import Path

    from tokenizers import Tokenizer

    import kestrel

    tok = Tokenizer.from_file(str(Path(kestrel.__file__).parent / "assets" / "kestrel-mini" / "tokenizer.json"))
    return tok.token_to_id(MARKERS[0])


def assert_plain_content(resp: httpx.Response) -> None:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert not choice["message"].get("tool_calls") and choice["finish_reason"] != "tool_calls", choice
    content = choice["message"]["content"] or ""
    assert not any(m in content for m in MARKERS) and "tool_calls_section" not in content, content


def test_auto_tool_choice_calls_get_weather_for_the_weather_prompt(http):
    # The premise of the "none" tests below: unconstrained, kestrel-mini does call the tool here.
    assert [name for name, _ in calls_of(chat(http, WEATHER_PROMPT, tools=[WEATHER], tool_choice="auto"))] == [
        "get_weather"
    ]


@pytest.mark.parametrize("body", [{"tools": [WEATHER], "tool_choice": "none"}, {}, {"tool_choice": "none"}])
def test_tool_call_markup_never_reaches_content_when_tools_are_not_allowed(http, body):
    assert_plain_content(chat(http, WEATHER_PROMPT, **body))


def test_tool_marker_ban_overrides_a_client_logit_bias(http):
    # +100 would make greedy decoding pick the section-begin token at once; the ban wins over the client's bias.
    bias = {str(section_begin_id()): 100}
    assert_plain_content(chat(http, WEATHER_PROMPT, tools=[WEATHER], tool_choice="none", logit_bias=bias))
    assert_plain_content(chat(http, WEATHER_PROMPT, logit_bias=bias))
