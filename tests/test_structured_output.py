"""Structured output (`response_format`): xgrammar masks keep the embedded model's output valid JSON."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_harness import running_server

from kestrel.chat_template import render_chat
from kestrel.engine.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}
CLOSED_RECORD = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": -5, "maximum": 99},
    },
    "required": ["word", "count"],
    "additionalProperties": False,
}
PROMPTS = ["What is 15% of 240?", "Describe a cat.", "Give me a person."]
QUOTE, CLOSE = 4, 95  # byte-level ids of '"' and '}' in kestrel-mini's tokenizer


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model=None, dtype="float32", device="cpu", max_total_tokens=8192, max_model_len=2048))


def run(engine: Engine, prompts: list[str], params: list[SamplingParams]) -> list:
    """Submit all prompts at once (one batch) and return their completions in order."""
    rids = [engine.add_request(render_chat([{"role": "user", "content": p}]), sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished:
        for out in engine.step().finished:
            done[out.request_id] = out.outputs[0]
    return [done[r] for r in rids]


def test_json_schema_output_has_the_required_keys_with_their_types(engine):
    grammar = engine.grammar.compile("json_schema", PERSON, strict=True)
    params = [SamplingParams(max_tokens=200, temperature=t, seed=1, grammar=grammar) for t in (0.0, 1.0)]
    for out in run(engine, PROMPTS * 2, params * len(PROMPTS)):
        assert out.finish_reason == "stop", out.text
        obj = json.loads(out.text)
        assert set(obj) == {"name", "age"}  # strict: no other keys
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150


def test_fifty_json_schema_answers_in_one_batch_parse_and_validate(engine):
    # Issue 12's acceptance check: 50 answers, greedy and sampled, each one a complete JSON value of the schema.
    grammar = engine.grammar.compile("json_schema", CLOSED_RECORD)
    topics = ["a cat", "the sea", "15% of 240", "a person", "rain", "numbers", "a city", "music", "bread", "time"]
    prompts = [f"Answer in JSON about {t}." for t in topics] * 5
    # Greedy for the first ten, sampled for the rest; 128 tokens leaves room for the whitespace runs the grammar allows.
    temps = [0.0] * 10 + [1.0] * 40
    params = [SamplingParams(max_tokens=128, temperature=t, seed=i, grammar=grammar) for i, t in enumerate(temps)]
    for out in run(engine, prompts, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), CLOSED_RECORD)


def test_json_object_output_parses(engine):
    # Unconstrained, this tiny model writes prose after `{"` and never closes the string; the bias makes it close
    # strings and objects early, and the grammar decides where a quote or brace is even allowed.
    grammar = engine.grammar.compile("json_object")
    bias = {QUOTE: 100.0, CLOSE: 10.0}
    params = [SamplingParams(max_tokens=64, temperature=t, seed=2, grammar=grammar, logit_bias=bias) for t in (0, 1)]
    for out in run(engine, PROMPTS * 2, params * len(PROMPTS)):
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict)


def test_request_without_a_grammar_is_unaffected_by_a_constrained_neighbour(engine):
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    (alone,) = run(engine, PROMPTS[:1], [plain])
    grammar = engine.grammar.compile("json_schema", PERSON, strict=True)
    both = run(engine, PROMPTS[:2], [plain, SamplingParams(max_tokens=24, temperature=0.0, grammar=grammar)])
    assert both[0].token_ids == alone.token_ids
    assert both[1].text.startswith('{"name"')


@pytest.fixture(scope="module")
def http():
    with running_server(None) as (url, _), httpx.Client(base_url=url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_response_format_over_http(http, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    body = {"messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 200, "response_format": fmt}
    if not stream:
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        content, reason = choice["message"]["content"], choice["finish_reason"]
    else:
        content, reason = "", None
        with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        content += c["delta"].get("content") or ""
                        reason = c["finish_reason"] or reason
    assert reason == "stop"
    assert set(json.loads(content)) == {"name", "age"}


def test_completions_json_object_response_format_over_http(http):
    body = {"prompt": "A JSON object:", "max_tokens": 64, "response_format": {"type": "json_object"}}
    body["logit_bias"] = {str(QUOTE): 100, str(CLOSE): 10}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["text"]), dict)


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "has space", "schema": PERSON}},
        {"type": "yaml"},
    ],
)
def test_invalid_response_format_is_a_400_naming_it(http, fmt):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": fmt}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith("response_format"), err
