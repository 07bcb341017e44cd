"""Fuzzing the chat endpoint: random bodies, most of them valid enough to reach the engine, never get a 5xx."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import MAX_BODY, WEATHER_TOOL, assert_openai_error, running_server

from kestrel.chat_template import MARKER_TOKENS, SPECIAL_TOKENS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kestrel.models.checkpoint import make_model

    checkpoint = str(make_model("kimi_k3", "tiny", tmp_path_factory.mktemp("fuzz") / "k3", seed=0))
    with running_server(checkpoint, max_request_bytes=MAX_BODY) as (url, name):
        with httpx.Client(base_url=url, timeout=60) as http:
            yield http, name


# -- fuzz ----------------------------------------------------------------------------------------------------------
# The engine flushes subnormal floats to zero (a CPU speed-up), so hypothesis must not generate them.
_junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_subnormal=False),
    st.text(max_size=12),
    st.lists(st.integers(-3, 600), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """`valid`, rarely junk: then most bodies get past validation into the template, the engine and the parsers."""
    return st.lists(st.booleans(), min_size=5, max_size=5).flatmap(lambda bits: _junk if all(bits) else valid)


def _floats(lo: float, hi: float) -> st.SearchStrategy:
    return st.floats(lo, hi, allow_subnormal=False)


_text = st.lists(st.one_of(st.text(max_size=8), st.sampled_from([*MARKER_TOKENS, *SPECIAL_TOKENS])), max_size=3).map(
    "".join
)
_call = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": _text, "arguments": _mostly(_text)})},
    optional={"id": _text},
)
_message = st.fixed_dictionaries(
    {
        "role": _mostly(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
        "content": _mostly(st.one_of(_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text})))),
    },
    optional={"tool_calls": _mostly(st.lists(_call, max_size=2)), "tool_call_id": _text, "reasoning_content": _text},
)
_tool = st.fixed_dictionaries(
    {
        "type": _mostly(st.just("function")),
        "function": st.fixed_dictionaries(
            {"name": _mostly(st.sampled_from(["get_weather", "f", "a.b-c"]))},
            optional={"parameters": _mostly(st.just(WEATHER_TOOL["function"]["parameters"])), "description": _text},
        ),
    }
)
_choice = {"type": "function", "function": {"name": "get_weather"}}
_fields = {
    "model": _mostly(st.just("?")),
    "max_completion_tokens": _mostly(st.integers(1, 2)),
    "temperature": _mostly(_floats(0, 2)),
    "top_p": _mostly(_floats(0.01, 1)),
    "top_k": _mostly(st.integers(-1, 700)),
    "min_p": _mostly(_floats(0, 1)),
    "presence_penalty": _mostly(_floats(-2, 2)),
    "frequency_penalty": _mostly(_floats(-2, 2)),
    "repetition_penalty": _mostly(_floats(0.01, 1e30)),
    "n": _mostly(st.integers(1, 2)),
    "stream": _mostly(st.booleans()),
    "stream_options": _mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": _mostly(st.one_of(_text, st.lists(_text, max_size=3))),
    "seed": _mostly(st.integers(-(2**63), 2**64)),
    "logprobs": _mostly(st.booleans()),
    "top_logprobs": _mostly(st.integers(0, 20)),
    "tools": _mostly(st.lists(_tool, max_size=1)),
    "tool_choice": _mostly(st.sampled_from(["none", "auto", "required", _choice])),
    "reasoning_effort": _mostly(st.sampled_from(["low", "high", "max"])),
    "min_tokens": _mostly(st.integers(0, 2)),
    "ignore_eos": _mostly(st.booleans()),
    "stop_token_ids": _mostly(st.lists(st.integers(0, 2**64), max_size=3)),
    "skip_special_tokens": _mostly(st.booleans()),
}
# max_tokens is always there and never null, and prompts stay short: a valid body costs a few engine steps.
_chat_body = st.fixed_dictionaries(
    {"messages": _mostly(st.lists(_message, min_size=1, max_size=2)), "max_tokens": _mostly(st.integers(1, 2))},
    optional=_fields,
).filter(lambda b: b["max_tokens"] is not None)
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_subnormal=False), st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
_raw_body = st.one_of(
    _chat_body.map(json.dumps), _chat_body.map(json.dumps), _json.map(json.dumps), st.binary(max_size=40)
)


@settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    database=None,
)
@given(body=_raw_body)
def test_fuzzed_chat_bodies_never_get_a_5xx(server, body):
    http, name = server
    if isinstance(body, str) and '"model": "?"' in body:
        body = body.replace('"model": "?"', json.dumps({"model": name})[1:-1])
    r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    assert "server_error" not in r.text
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)
