"""The OpenAI-compatible server, driven over real HTTP (uvicorn in a thread) by the `openai` client and httpx."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_harness import MAX_MODEL_LEN, running_server

import kestrel

MAX_BODY = 64 << 10
API_KEY = "test-key"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = [{"role": "user", "content": "What's the weather like in Beijing today?"}]
TRAINED_MODEL = Path(kestrel.__file__).parent / "assets" / "kestrel-mini" / "config.json"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from kestrel.models.checkpoint import make_model

    return str(make_model("kimi_k3", "tiny", tmp_path_factory.mktemp("server") / "k3", seed=0))


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(checkpoint, max_request_bytes=MAX_BODY) as (url, name):
        yield url, name


@pytest.fixture(scope="module")
def guarded(checkpoint):
    """A second server: API key required, two running slots, at most one queued request, no reasoning parser."""
    kwargs = dict(api_key=API_KEY, max_queued_requests=1, served_model_name="kimi", reasoning_parser="none")
    with running_server(checkpoint, {"max_running_requests": 2}, **kwargs) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def metrics(http: httpx.Client) -> dict[str, float]:
    """`name{labels}` → value of every sample on /metrics."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def aborted(m: dict[str, float]) -> float:
    return m.get('kestrel_requests_finished_total{finish_reason="abort"}', 0.0)


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        keys = ("kestrel_num_running_requests", "kestrel_kv_pages_used", "kestrel_state_slots_used")
        if all(m[k] == 0 for k in keys) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# -- basics ------------------------------------------------------------------------------------------------
def test_models_lists_the_served_model_and_health_is_open(http, server):
    assert http.get("/health").status_code == 200
    data = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [server[1]] and data[0]["max_model_len"] == MAX_MODEL_LEN


def test_chat_completion_is_well_formed_with_usage(client, server):
    resp = client.chat.completions.create(model=server[1], messages=USER, max_tokens=8, temperature=0)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length", "tool_calls")
    u = resp.usage
    assert 0 < u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0


def test_repeated_prefix_reports_cached_tokens_in_usage_and_metrics(client, server, http):
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    messages = [system, {"role": "user", "content": "Tell me about prefix caching."}]
    first = client.chat.completions.create(model=server[1], messages=messages, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model=server[1], messages=messages, max_tokens=4, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0
    assert again.choices[0].message.content == first.choices[0].message.content
    m = wait_idle(http)
    assert m['kestrel_prefix_cache_hit_tokens{tier="device"}'] >= cached
    assert m["kestrel_prefix_cache_checkpoints"] > 0 and m["kestrel_prefix_cache_pages"] > 0


def test_disk_tier_counters_are_exported_to_metrics(checkpoint, tmp_path):
    """Guards issue 12 #18: the disk tier's file counters in `Engine.stats()` reach /metrics."""
    engine_kwargs = {"hicache_storage_dir": str(tmp_path), "hicache_write_policy": "write_through"}
    with running_server(checkpoint, engine_kwargs) as (url, name), httpx.Client(base_url=url, timeout=60) as http:
        body = {"model": name, "messages": USER, "max_tokens": 2, "temperature": 0}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        m = wait_idle(http)
    files = [f for f in tmp_path.rglob("*") if f.suffix in (".page", ".state")]
    assert m["kestrel_hicache_disk_files_written"] == len(files) > 0
    assert m["kestrel_prefix_cache_disk_corrupt_files"] == 0 and m["kestrel_prefix_cache_disk_io_errors"] == 0


def _collect_stream(stream):
    """Streamed chunks → per choice: content, reasoning, merged tool calls, finish reason; plus the usage chunk."""
    got: dict[int, dict] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            g = got.setdefault(c.index, {"content": "", "reasoning": "", "calls": {}, "finish": None})
            g["content"] += c.delta.content or ""
            g["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            for tc in c.delta.tool_calls or []:
                call = g["calls"].setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                call["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                assert g["finish"] is None
                g["finish"] = c.finish_reason
    return got, usage


def test_streamed_chat_deltas_concatenate_to_the_non_streamed_response(client, server):
    kwargs = dict(model=server[1], messages=USER, max_tokens=40, temperature=0.9, seed=11, n=2)
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    got, usage = _collect_stream(stream)
    assert sorted(got) == [0, 1]
    for choice in whole.choices:
        g, msg = got[choice.index], choice.message
        assert g["content"] == (msg.content or "")
        assert g["reasoning"] == (getattr(msg, "reasoning_content", None) or "")
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]
        assert list(g["calls"].values()) == calls
        assert g["finish"] == choice.finish_reason
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()


def test_usage_chunk_only_when_asked(client, server):
    _, usage = _collect_stream(
        client.chat.completions.create(model=server[1], messages=USER, max_tokens=3, stream=True)
    )
    assert usage is None


def test_chat_logprobs_one_entry_per_generated_token(client, server):
    resp = client.chat.completions.create(
        model=server[1], messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)


def test_chat_logprob_bytes_are_the_raw_bytes_of_a_byte_level_token(client, server):
    from kestrel.tokenizer import BYTE_SPECIALS

    lead = len(BYTE_SPECIALS) + 0xE4  # the byte-level token of 0xE4: the first byte of a 3-byte UTF-8 character
    resp = client.chat.completions.create(
        model=server[1], messages=USER, max_tokens=2, temperature=0, logprobs=True, top_logprobs=1,
        extra_body={"logit_bias": {str(lead): 100}, "ignore_eos": True},
    )  # fmt: skip
    entries = resp.choices[0].logprobs.content
    assert [e.bytes for e in entries] == [[0xE4], [0xE4]]


def test_completions_batch_and_stream_agree(http, server):
    body = {"model": server[1], "prompt": ["Hello", "Hi"], "max_tokens": 12, "n": 2, "temperature": 0.8, "seed": 5}
    whole = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    texts: dict[int, str] = {}
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for c in json.loads(line.removeprefix("data: "))["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert whole["usage"]["completion_tokens"] <= 4 * 12


def test_sampling_knobs_are_accepted(client, server):
    resp = client.chat.completions.create(
        model=server[1],
        messages=USER,
        max_completion_tokens=5,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        stop=["\n\n", "zz"],
        seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 5, "ignore_eos": True},
    )
    assert resp.usage.completion_tokens == 5 or resp.choices[0].finish_reason == "stop"


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_it(http, checkpoint):
    from kestrel.tokenizer import load_tokenizer

    prompt = [5, 17, 99, 3]
    greedy = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    (top,) = http.post("/generate", json=greedy).json()["output_ids"]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
    forced = load_tokenizer(checkpoint).encode("Q").ids[0]
    out = http.post("/v1/completions", json=body | {"logit_bias": {str(forced): 100}}).json()["choices"][0]
    assert out["text"] == "QQQQ"
    banned = http.post("/v1/completions", json=body | {"logit_bias": {str(top): -100}}).json()["choices"][0]
    # Logprobs are the model's own, so the first token lost its place to a less likely one.
    assert banned["logprobs"]["token_logprobs"][0] < plain[0]


def test_text_response_format_best_of_n_and_template_reasoning_effort_are_honoured(client, server):
    kwargs = dict(model=server[1], messages=USER, max_tokens=1, n=2)
    resp = client.chat.completions.create(**kwargs, response_format={"type": "text"}, extra_body={"best_of": 2})
    assert len(resp.choices) == 2
    high = _prompt_tokens(client, server[1], extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    assert high == _prompt_tokens(client, server[1], reasoning_effort="high") > _prompt_tokens(client, server[1])


# -- chat template knobs and tools ---------------------------------------------------------------------------
def _prompt_tokens(client, name, **kwargs) -> int:
    return client.chat.completions.create(model=name, messages=USER, max_tokens=1, **kwargs).usage.prompt_tokens


def test_reasoning_effort_defaults_to_max_and_reaches_the_template(client, server):
    default = _prompt_tokens(client, server[1])
    assert _prompt_tokens(client, server[1], reasoning_effort="max") == default
    assert _prompt_tokens(client, server[1], reasoning_effort="high") == default + 1  # byte tokens: "high" vs "max"


def test_openai_reasoning_efforts_map_to_the_nearest_supported_level(client, server):
    assert _prompt_tokens(client, server[1], reasoning_effort="minimal") == _prompt_tokens(
        client, server[1], reasoning_effort="low"
    )
    assert _prompt_tokens(client, server[1], reasoning_effort="medium") == _prompt_tokens(
        client, server[1], reasoning_effort="high"
    )


def test_tool_choice_none_keeps_tools_out_of_the_prompt(client, server):
    with_tools = _prompt_tokens(client, server[1], tools=[WEATHER_TOOL])
    assert _prompt_tokens(client, server[1], tools=[WEATHER_TOOL], tool_choice="none") < with_tools
    assert _prompt_tokens(client, server[1], tools=[WEATHER_TOOL], tool_choice="auto") == with_tools


@pytest.mark.parametrize(
    "tool_choice", ["auto", "required", "none", {"type": "function", "function": {"name": "get_weather"}}]
)
@pytest.mark.parametrize("stream", [False, True])
def test_tools_are_accepted_and_the_response_is_well_formed(client, server, tool_choice, stream):
    kwargs = dict(model=server[1], messages=USER, tools=[WEATHER_TOOL], tool_choice=tool_choice, max_tokens=16)
    if stream:
        got, _ = _collect_stream(client.chat.completions.create(**kwargs, stream=True))
        g = got[0]
        assert g["finish"] in ("stop", "length", "tool_calls")
        assert all(c["id"] and c["name"] for c in g["calls"].values())
        return
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("functions.") and call.function.name


@pytest.mark.skipif(not TRAINED_MODEL.exists(), reason="needs the trained embedded model kestrel-mini")
def test_trained_model_reasons_then_answers():
    """The seed cookbook's §3.1 snippet: reasoning_effort="high" gives reasoning_content and content."""
    with running_server(None) as (url, name):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        resp = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "What is 15% of 240?"}],
            reasoning_effort="high",
        )
        msg = resp.choices[0].message
        assert getattr(msg, "reasoning_content", None) and msg.content


@pytest.mark.skipif(not TRAINED_MODEL.exists(), reason="needs the trained embedded model kestrel-mini")
def test_trained_model_calls_get_weather_for_beijing():
    """The seed cookbook's §3.2 snippet (its message and tool schema), only base_url and model changed."""
    with running_server(None) as (url, name):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What's the weather in Beijing?"}]
        kwargs = dict(model=name, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=256)
        resp = client.chat.completions.create(**kwargs)
        (call,) = resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Beijing"}
        got, _ = _collect_stream(client.chat.completions.create(**kwargs, stream=True))
        (streamed,) = got[0]["calls"].values()
        assert streamed == {"id": call.id, "name": "get_weather", "arguments": call.function.arguments}


# -- the engine hooks streaming relies on ----------------------------------------------------------------------------
def test_engine_step_reports_exactly_the_requests_that_sampled_a_token(checkpoint):
    from kestrel import LLM, SamplingParams

    engine = LLM(checkpoint, device="cpu", max_total_tokens=2048, chunked_prefill_size=16).engine
    greedy = dict(temperature=0, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, **greedy))]
    ids.append(engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=2, n=2, **greedy)))  # chunked
    reqs = [r for rid in ids for r in engine.requests(rid)]
    saw_prefill_only_step = False
    while engine.has_unfinished:
        before = [len(r.output_ids) for r in reqs]
        result = engine.step()
        grew = [r for r, n in zip(reqs, before) if len(r.output_ids) > n]
        assert sorted(map(id, result.advanced)) == sorted(map(id, grew))
        saw_prefill_only_step |= len(grew) < sum(not r.is_finished for r in reqs)
    assert saw_prefill_only_step and all(len(r.output_ids) == r.params.max_tokens for r in reqs)


# -- /generate and /abort_request -----------------------------------------------------------------------------
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_generate_capture_is_opt_in_and_needs_the_server_flag(http):
    meta = http.post("/generate", json={"input_ids": [5, 17, 99], "sampling_params": GREEDY}).json()["meta_info"]
    assert "routed_experts" not in meta and "indexer_topk" not in meta
    for field in ("return_routed_experts", "return_indexer_topk"):
        r = http.post("/generate", json={"input_ids": [5, 17, 99], "sampling_params": GREEDY, field: True})
        assert "--enable-return-" in assert_openai_error(r, 400, field)["message"]


def test_generate_input_token_logprobs_start_at_logprob_start_len(http):
    prompt = [5, 17, 99, 3, 42, 7]
    body = {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2}
    whole = http.post("/generate", json=body | {"logprob_start_len": 0}).json()["meta_info"]
    entries = whole["input_token_logprobs"]
    assert [t for _, t, _ in entries] == prompt and entries[0] == [None, prompt[0], None]
    assert all(lp <= 0 for lp, _, _ in entries[1:]) and whole["input_top_logprobs"][0] is None
    assert all(len(top) == 2 for top in whole["input_top_logprobs"][1:])
    tail = http.post("/generate", json=body | {"logprob_start_len": 2}).json()["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in tail] == prompt[2:]
    assert [lp for lp, _, _ in tail] == pytest.approx([lp for lp, _, _ in entries[2:]], abs=1e-4)
    assert "input_token_logprobs" not in http.post("/generate", json=body).json()["meta_info"]
    assert_openai_error(http.post("/generate", json=body | {"logprob_start_len": 6}), 400, "logprob_start_len")
    no_lp = {"input_ids": prompt, "logprob_start_len": 0}
    assert_openai_error(http.post("/generate", json=no_lp), 400, "logprob_start_len")


@pytest.mark.parametrize("key, batch", [("text", ["Hello", "Hi there"]), ("input_ids", [[5, 17, 99], [3, 42]])])
def test_generate_batch_returns_one_result_per_prompt_in_order(http, key, batch):
    out = http.post("/generate", json={key: batch, "sampling_params": GREEDY}).json()
    singles = [http.post("/generate", json={key: p, "sampling_params": GREEDY}).json() for p in batch]
    assert isinstance(out, list) and [r["output_ids"] for r in out] == [r["output_ids"] for r in singles]
    assert [r["meta_info"]["prompt_tokens"] for r in out] == [r["meta_info"]["prompt_tokens"] for r in singles]
    one = http.post("/generate", json={key: batch[:1], "sampling_params": GREEDY}).json()
    assert isinstance(one, list) and len(one) == 1  # a batch of one is still a batch


def test_generate_stream_sends_cumulative_text_then_done(http):
    body = {"text": "Hello", "sampling_params": GREEDY, "return_logprob": True}
    whole = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json=body | {"stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len(chunks) > 1
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    last = chunks[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert len(last["meta_info"]["output_token_logprobs"]) == 6


def test_abort_request_ends_a_running_generate(http):
    body = {"input_ids": [1, 2, 3], "rid": "rollout-7", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    result = {}
    worker = threading.Thread(target=lambda: result.update(http.post("/generate", json=body).json()))
    worker.start()
    deadline = time.monotonic() + 10
    while not http.post("/abort_request", json={"rid": "rollout-7"}).json()["aborted"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    worker.join(30)
    assert result["meta_info"]["finish_reason"] == {"type": "abort"}
    assert len(result["output_ids"]) < 900
    assert wait_idle(http)["kestrel_kv_pages_used"] == 0


# -- many clients, disconnects -----------------------------------------------------------------------------------
def test_32_streaming_clients_8_disconnect_and_every_page_and_slot_is_freed(server, http):
    url, name = server
    before = aborted(metrics(http))

    async def one(ac: httpx.AsyncClient, i: int, leave: bool) -> str:
        body = {
            "model": name,
            "messages": [{"role": "user", "content": f"client {i}"}],
            "stream": True,
            "logprobs": True,  # every token yields a chunk, even while text is held back
            "temperature": 0.9,
            "seed": i,
            "max_tokens": 900 if leave else 12,
            "ignore_eos": leave,
        }
        chunks, finish = 0, None
        async with ac.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return f"done:{finish}"
                chunks += 1
                if leave and chunks == 4:
                    return "left"  # leaving the block closes the connection mid-stream
                for c in json.loads(line[6:])["choices"]:
                    finish = c["finish_reason"] or finish
        return "truncated"

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
            return await asyncio.gather(*(one(ac, i, i % 4 == 0) for i in range(32)))

    results = asyncio.run(main())
    assert results.count("left") == 8 and results.count("done:length") + results.count("done:stop") == 24
    m = wait_idle(http)
    assert m["kestrel_kv_pages_used"] == m["kestrel_state_slots_used"] == m["kestrel_num_running_requests"] == 0
    assert aborted(m) - before == 8


def test_non_streaming_client_that_disconnects_is_aborted(server, http):
    before = aborted(metrics(http))
    body = {"model": server[1], "messages": USER, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while aborted(metrics(http)) == before:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)
    assert wait_idle(http)["kestrel_kv_pages_used"] == 0


# -- errors ----------------------------------------------------------------------------------------------------------
MSG = [{"role": "user", "content": "hi"}]
NAMELESS_TOOL = {"type": "function", "function": {"parameters": {}}}
LIST_PARAMS_TOOL = {"type": "function", "function": {"name": "f", "parameters": []}}
UNKNOWN_CHOICE = {"type": "function", "function": {"name": "x"}}


@pytest.mark.parametrize(
    "body, status, param",
    [
        ('{"messages": [', 400, None),
        ({}, 400, "messages"),
        ({"messages": []}, 400, "messages"),
        ({"messages": "hi"}, 400, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ({"messages": MSG, "max_tokens": "10"}, 400, "max_tokens"),
        ({"messages": MSG, "stream": "yes"}, 400, "stream"),
        ({"messages": MSG, "stop": 7}, 400, "stop"),
        ({"messages": MSG, "temperature": -1}, 400, "temperature"),
        ({"messages": MSG, "top_p": 0}, 400, "top_p"),
        ({"messages": MSG, "n": 0}, 400, "n"),
        ({"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": MSG, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
        ({"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
        ({"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
        ({"messages": MSG, "seed": 2**80}, 400, "seed"),
        ({"messages": MSG, "reasoning_effort": "extreme"}, 400, "reasoning_effort"),
        ({"messages": MSG, "model": "gpt-4o"}, 404, "model"),
        ({"messages": MSG, "tools": [NAMELESS_TOOL]}, 400, "tools[0].function.name"),
        ({"messages": MSG, "tools": [{"type": "retrieval"}]}, 400, "tools[0].type"),
        ({"messages": MSG, "tools": [LIST_PARAMS_TOOL]}, 400, "tools[0].function.parameters"),
        ({"messages": MSG, "tools": [WEATHER_TOOL], "tool_choice": UNKNOWN_CHOICE}, 400, "tool_choice.function.name"),
        ({"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
        ({"messages": MSG, "tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, 400, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x" * (MAX_MODEL_LEN + 10)}]}, 400, "messages"),
        ({"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
        ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
         400, "response_format.json_schema.schema"),
        ({"messages": MSG, "best_of": 3}, 400, "best_of"),
        ({"messages": MSG, "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ({"messages": MSG, "logit_bias": {"five": 1}}, 400, "logit_bias"),
        ({"messages": MSG, "logit_bias": {str(10**6): 1}}, 400, "logit_bias"),
        ({"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}}, 400,
         "chat_template_kwargs.enable_thinking"),
        ({"messages": MSG, "chat_template_kwargs": {"reasoning_effort": "extreme"}}, 400,
         "chat_template_kwargs.reasoning_effort"),
    ],
)  # fmt: skip
def test_invalid_chat_requests_get_an_openai_error(http, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {}
    r = http.post("/v1/chat/completions", json=None if kwargs else body, **kwargs)
    err = assert_openai_error(r, status, param)
    if status == 404:
        assert err["code"] == "model_not_found"


def test_too_long_prompt_names_the_context_limit(http):
    body = {"messages": [{"role": "user", "content": "x" * (MAX_MODEL_LEN + 10)}]}
    err = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, "messages")
    assert str(MAX_MODEL_LEN) in err["message"] and err["code"] == "context_length_exceeded"


LONE_SURROGATE = "a\\ud800b"  # the JSON escape of a lone surrogate: valid JSON, but not Unicode text


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}]}', "messages[0].content"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
         "messages[0].content"),
        ("/v1/completions", '{"prompt": "%s", "max_tokens": 1}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "%s"], "max_tokens": 1}', "prompt"),
        ("/generate", '{"text": "%s"}', "text"),
    ],
)  # fmt: skip
def test_lone_surrogate_in_text_is_a_400_naming_the_field(http, path, body, param):
    r = http.post(path, content=body % LONE_SURROGATE, headers={"content-type": "application/json"})
    assert "surrogate" in assert_openai_error(r, 400, param)["message"]


CHAT_HI = '{"messages": [{"role": "user", "content": "hi"}], %s}'  # raw JSON: Infinity and NaN are not json=


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", CHAT_HI % '"max_tokens": 1e30', "max_tokens"),
        ("/v1/chat/completions", CHAT_HI % ('"max_tokens": 1' + "0" * 30), "max_tokens"),
        ("/v1/chat/completions", CHAT_HI % '"temperature": Infinity', "temperature"),
        ("/v1/chat/completions", CHAT_HI % '"temperature": NaN', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "top_p": -Infinity}', "top_p"),
        ("/generate", '{"input_ids": [1], "sampling_params": {"top_k": 2, "temperature": Infinity}}',
         "sampling_params.temperature"),
    ],
)  # fmt: skip
def test_non_finite_or_absurd_numbers_are_a_400_naming_the_field(http, path, body, param):
    assert_openai_error(http.post(path, content=body, headers={"content-type": "application/json"}), 400, param)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": MAX_MODEL_LEN - 1}, "max_tokens"),
        ("/v1/completions", {"prompt": [[1], [1, 2]], "max_tokens": MAX_MODEL_LEN - 1}, "max_tokens"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": MAX_MODEL_LEN - 1}},
         "sampling_params.max_new_tokens"),
    ],
)  # fmt: skip
def test_prompt_plus_max_tokens_beyond_the_context_is_a_400_not_a_truncation(http, path, body, param):
    err = assert_openai_error(http.post(path, json=body), 400, param)
    assert str(MAX_MODEL_LEN) in err["message"] and err["code"] == "context_length_exceeded"


def test_prompt_plus_max_tokens_equal_to_the_context_is_accepted(http):
    body = {"input_ids": [1] * (MAX_MODEL_LEN - 2), "sampling_params": {"max_new_tokens": 2}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text


def test_image_input_is_refused_as_unsupported_naming_the_part(http):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content = [{"type": "text", "text": "what is this?"}, image]
    body = {"messages": [*MSG, {"role": "user", "content": content}], "max_tokens": 1}
    err = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, "messages[1].content[1]")
    assert "image input is not supported" in err["message"]


def test_empty_prompt_list_says_the_prompt_must_not_be_empty(http):
    err = assert_openai_error(http.post("/v1/completions", json={"prompt": []}), 400, "prompt")
    assert "prompt must not be empty" in err["message"]


def test_oversized_body_is_413(http):
    body = {"messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    assert_openai_error(http.post("/v1/chat/completions", json=body), 413)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "suffix": "bye"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "best_of": 2, "n": 1}, "best_of"),
        ("/generate", {"text": "a", "input_ids": [1]}, "input_ids"),
        ("/generate", {"input_ids": [1], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
        ("/abort_request", {}, "rid"),
    ],
)
def test_invalid_requests_to_other_endpoints_get_an_openai_error(http, path, body, param):
    assert_openai_error(http.post(path, json=body), 400, param)


def test_api_key_guards_every_v1_route_but_not_health(guarded):
    url, name = guarded
    chat = {"model": name, "messages": MSG, "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert_openai_error(httpx.post(url + "/v1/chat/completions", json=chat, headers=headers), 401)
        assert_openai_error(httpx.get(url + "/v1/models", headers=headers), 401)
    assert_openai_error(httpx.post(url + "/v1/chat/completions", content="{", headers={}), 401)
    assert httpx.get(url + "/health").status_code == 200
    ok = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert ok.chat.completions.create(**chat).usage.completion_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_reasoning_parser_none_leaves_reasoning_in_content(guarded, http):
    body = {"messages": MSG, "max_tokens": 2}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    plain = httpx.post(guarded[0] + "/v1/chat/completions", json=body, headers=headers).json()
    assert "reasoning_content" not in plain["choices"][0]["message"]
    assert "reasoning_content" in http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]


def test_requests_beyond_the_queue_limit_get_503_with_retry_after(guarded):
    url = guarded[0]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    rids = [f"q{i}" for i in range(5)]  # 2 run, 1 may wait, the rest are refused
    sampling = {"max_new_tokens": 900, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=60) as ac:
            posts = [
                ac.post("/generate", json={"input_ids": [1, 2], "rid": rid, "sampling_params": sampling})
                for rid in rids
            ]
            tasks = [asyncio.create_task(p) for p in posts]
            await asyncio.sleep(0.5)
            for rid in rids:
                await ac.post("/abort_request", json={"rid": rid})
            return await asyncio.gather(*tasks)

    responses = asyncio.run(main())
    assert sorted(r.status_code for r in responses) == [200, 200, 200, 503, 503]
    refused = [r for r in responses if r.status_code == 503]
    assert all(r.headers["retry-after"] for r in refused)
    assert_openai_error(refused[0], 503)


# -- the command line ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kestrel_serve_logs_capacity_and_url_and_sigint_lets_inflight_requests_finish(checkpoint, tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "kestrel.cli", "serve", checkpoint, "--port", str(port), "--device", "cpu"]
    cmd += ["--max-total-tokens", "4096", "--max-model-len", "1024"]
    log_file = open(tmp_path / "serve.log", "w+")  # a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen(cmd, stderr=log_file, stdout=log_file, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        body = {"messages": MSG, "max_tokens": 200, "ignore_eos": True, "stream": True, "logprobs": True}
        lines = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 3:
                    proc.send_signal(signal.SIGINT)  # once: a second SIGINT means "force quit" to uvicorn
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
        log = (tmp_path / "serve.log").read_text()
        assert "capacity" in log and url in log
        assert "Traceback" not in log and "shutdown failed" not in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log_file.close()


def test_server_engine_leaves_one_core_to_the_http_thread():
    """On CPU the serving engine takes every usable core but one (its OpenMP pool would contend with HTTP)."""
    from kestrel.engine.config import EngineConfig
    from kestrel.server.args import ServerConfig
    from kestrel.server.launch import make_server

    before = torch.get_num_threads()
    try:
        make_server(EngineConfig(device="cpu", max_total_tokens=512), ServerConfig(port=0))
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) - 1)
        make_server(EngineConfig(device="cpu", max_total_tokens=512, num_threads=3), ServerConfig(port=0))
        assert torch.get_num_threads() == 3  # an explicit --num-threads wins
    finally:
        torch.set_num_threads(before)


def _serve(checkpoint: str, tmp_path: Path, name: str, *flags: str) -> tuple[subprocess.Popen, str, Path]:
    """`kestrel serve` in a subprocess on a free port; returns (process, URL, log file) once /health answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kestrel.cli", "serve", checkpoint, "--port", str(port), "--device", "cpu", *flags]
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "w") as log_file:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, stderr=log_file, stdout=log_file, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health").status_code == 200:
                return proc, url, log_path
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not come up:\n" + log_path.read_text())
        time.sleep(0.1)


def test_sigint_with_write_back_flushes_the_disk_tier_and_a_restart_hits_it(checkpoint, tmp_path):
    """write_back keeps cached pages in memory only; SIGINT must write them to disk (exit 0, no traceback), and
    a new server on the same directory serves the same prompt from disk."""
    store = tmp_path / "l3"
    flags = ("--max-total-tokens", "4096", "--max-model-len", "1024", "--page-size", "8")
    flags += ("--hicache-storage-dir", str(store), "--hicache-write-policy", "write_back")
    prompt = list(range(5, 120))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    proc, url, log = _serve(checkpoint, tmp_path, "first", *flags)
    try:
        for _ in range(2):
            assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200
        assert not list(store.rglob("*.page"))  # write_back: nothing on disk before shutdown
    finally:
        _stop_cleanly(proc, signal.SIGINT, log)
    assert list(store.rglob("*.page")) and list(store.rglob("*.state"))
    proc, url, log = _serve(checkpoint, tmp_path, "second", *flags)
    try:
        out = httpx.post(url + "/generate", json=body, timeout=60).json()
        assert out["meta_info"]["cached_tokens_by_tier"]["disk"] > 0, out["meta_info"]
    finally:
        _stop_cleanly(proc, signal.SIGTERM, log)


# A server still loading: `make_server` stands in for the model load / kernel build, so the signal lands there.
STARTING_SERVER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job of a non-interactive shell inherits it
from kestrel.server import launch
def loading(*args):
    print("loading", flush=True)
    time.sleep(120)
    sys.exit(3)
launch.make_server = loading
launch.serve(None, None)
print("stopped", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_server_is_still_starting_stops_it_cleanly(sig):
    """The signal arrives before uvicorn's own handlers exist, and SIGINT was inherited ignored: the server must
    still stop (exit 0, no traceback) instead of going on to serve."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STARTING_SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "loading"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.strip() == "stopped", (proc.returncode, out, err)
    assert "Traceback" not in err


def _stop_cleanly(proc: subprocess.Popen, sig: int, log: Path) -> None:
    """Signal a `_serve` server once; it must exit 0 with no traceback (killed, and failing, if it hangs)."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text()


# -- the queue cap admits a request as a whole (issue 12 #9) ---------------------------------------------------------
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _with_running(url: str, count: int, probe):
    """Run `probe(client)` while `count` long /generate requests hold running slots of the guarded server."""
    rids = [f"hold{i}" for i in range(count)]
    sampling = {"max_new_tokens": 900, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as ac:
            bodies = [{"input_ids": [1, 2], "rid": rid, "sampling_params": sampling} for rid in rids]
            held = [asyncio.create_task(ac.post("/generate", json=b)) for b in bodies]
            deadline = time.monotonic() + 10
            while (await ac.get("/metrics")).text.count(f"kestrel_num_running_requests {count}.0") == 0:
                assert time.monotonic() < deadline, "the long requests did not start"
                await asyncio.sleep(0.02)
            try:
                return await probe(ac)
            finally:
                for rid in rids:
                    await ac.post("/abort_request", json={"rid": rid})
                await asyncio.gather(*held)

    return asyncio.run(main())


def test_queue_cap_admits_a_batch_as_a_whole_and_refuses_it_only_while_full(guarded):
    url, name = guarded
    body = {"model": name, "prompt": ["a", "b", "c"], "max_tokens": 1}  # 2 running slots + 1 queued: fits
    ok = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == 3

    async def probe(ac):
        return await ac.post("/v1/completions", json=body)

    busy = _with_running(url, 1, probe)  # one slot taken: two of the three prompts would queue
    assert_openai_error(busy, 503)
    assert busy.headers["retry-after"]


def test_queue_cap_counts_every_choice_of_n(guarded):
    url, name = guarded

    async def probe(ac):
        return await ac.post("/v1/completions", json={"model": name, "prompt": "a", "max_tokens": 1, "n": 2})

    refused = _with_running(url, 2, probe)  # both slots taken: n=2 would queue 2 sequences, the cap is 1
    assert_openai_error(refused, 503)
    assert refused.headers["retry-after"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 1, "n": 5}, "n"),
        ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1, "n": 2}, "n"),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 1, "n": 4}, "n"),
    ],
)
def test_request_larger_than_running_slots_plus_queue_is_a_400_naming_the_field(guarded, path, body, param):
    """2 running slots + at most 1 queued: 4 or more sequences can never be admitted, so retrying is pointless."""
    r = httpx.post(guarded[0] + path, json=body, headers=AUTH, timeout=60)
    err = assert_openai_error(r, 400, param)
    assert "--max-queued-requests" in err["message"] and "retry-after" not in r.headers


# -- shutdown ----------------------------------------------------------------------------------------------------------
def test_graceful_shutdown_timeout_ends_inflight_requests_with_a_503_error_and_exit_0(checkpoint, tmp_path):
    """Guards issue 12 #8: at the deadline a stream gets an error event and `[DONE]`, a non-streaming request a
    JSON 503 (both aborted through the engine, not cancelled by uvicorn); no traceback, exit code 0."""
    flags = ("--max-total-tokens", "16384", "--max-model-len", "8192", "--graceful-shutdown-timeout", "1")
    proc, url, log = _serve(checkpoint, tmp_path, "serve", *flags)
    long = {"messages": MSG, "max_tokens": 8000, "ignore_eos": True}
    plain: list[httpx.Response] = []
    try:
        waiter = threading.Thread(
            target=lambda: plain.append(httpx.post(url + "/v1/chat/completions", json=long, timeout=60))
        )
        waiter.start()
        deadline = time.monotonic() + 10
        with httpx.Client(base_url=url) as probe:
            while metrics(probe).get("kestrel_num_running_requests", 0) < 1:
                assert time.monotonic() < deadline, "the non-streaming request did not start"
                time.sleep(0.02)
        lines = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=long | {"stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 3:
                    proc.send_signal(signal.SIGINT)  # once: a second SIGINT means "force quit" to uvicorn
        waiter.join(30)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    err = json.loads(lines[-2][6:])["error"]
    assert "shutting down" in err["message"] and err["type"] == "overloaded_error", err
    (resp,) = plain
    assert_openai_error(resp, 503)
    assert "shutting down" in resp.json()["error"]["message"]
    text = log.read_text()
    assert "Traceback" not in text and "CancelledError" not in text and "Cancel " not in text, text


# -- SGLang's worker API ---------------------------------------------------------------------------------------
def test_get_model_info_has_sglangs_fields_and_names_the_checkpoint(http, checkpoint):
    info = http.get("/get_model_info").json()
    assert info == {
        "model_path": checkpoint,
        "tokenizer_path": checkpoint,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
    }


def test_get_server_info_lists_engine_and_server_args_version_and_internal_states(http, checkpoint):
    info = http.get("/get_server_info").json()
    assert info["model"] == info["model_path"] == checkpoint and info["page_size"] == 16
    assert info["max_model_len"] == MAX_MODEL_LEN and info["max_request_bytes"] == MAX_BODY
    assert info["version"] == "0.1.0" and info["api_key"] is None
    (state,) = info["internal_states"]
    assert state["max_total_num_tokens"] == 16384 and state["pages_total"] == 16384 // 16
    assert {"running", "waiting", "pages_used", "num_queued_reqs"} <= set(state)


def _cached_tokens(http: httpx.Client, ids: list[int]) -> int:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    return http.post("/generate", json=body).json()["meta_info"]["cached_tokens"]


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_flush_cache_empties_the_prefix_cache(http, method):
    ids = [7 + (i * 13 + len(method)) % 200 for i in range(48)]
    _cached_tokens(http, ids)
    assert _cached_tokens(http, ids) >= 32
    wait_idle(http)
    r = http.request(method, "/flush_cache")
    assert r.status_code == 200 and "flushed" in r.text.lower()
    state = http.get("/get_server_info").json()["internal_states"][0]
    assert state["prefix_cache_pages"] == 0 and state["prefix_cache_checkpoints"] == 0
    assert _cached_tokens(http, ids) == 0


def test_flush_cache_is_refused_while_a_request_runs(http):
    body = {"input_ids": [4, 5, 6], "rid": "flush-busy", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    result = {}
    worker = threading.Thread(target=lambda: result.update(http.post("/generate", json=body).json()))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while http.get("/get_server_info").json()["internal_states"][0]["running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert_openai_error(http.post("/flush_cache"), 400)
    finally:
        http.post("/abort_request", json={"rid": "flush-busy"})
        worker.join(30)
    assert result["meta_info"]["finish_reason"] == {"type": "abort"}
    wait_idle(http)
    assert http.post("/flush_cache").status_code == 200


def test_health_generate_runs_one_token_through_the_engine(http):
    before = metrics(http).get("kestrel_generation_tokens_total", 0.0)
    assert http.get("/health_generate").status_code == 200
    assert metrics(http)["kestrel_generation_tokens_total"] == before + 1


def test_api_key_guards_the_sglang_worker_api(guarded):
    url, _ = guarded
    paths = [("GET", "/get_model_info"), ("GET", "/get_server_info"), ("POST", "/flush_cache")]
    paths += [("GET", "/flush_cache"), ("GET", "/health_generate")]
    for method, path in paths:
        assert_openai_error(httpx.request(method, url + path), 401)
        r = httpx.request(method, url + path, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert r.status_code == 200, (path, r.text)
    info = httpx.get(url + "/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert info["api_key"] == "<hidden>" and info["max_running_requests"] == 2


def test_health_generate_and_flush_cache_are_503_when_the_engine_is_not_alive(checkpoint):
    from types import SimpleNamespace

    from kestrel.server.async_engine import AsyncEngine
    from kestrel.server.errors import APIError
    from kestrel.server.sglang_api import flush_cache, health_generate

    class Stopped(AsyncEngine):
        def __init__(self) -> None:
            self._thread = None  # never started: `alive` is False

    ctx = SimpleNamespace(engine=Stopped())
    for call in (health_generate(ctx, None), flush_cache(ctx)):
        with pytest.raises(APIError) as err:
            asyncio.run(call)
        assert err.value.status == 503
