"""LoRA over HTTP: `model` (OpenAI) and `lora_path` (SGLang /generate) pick adapters, /v1/models lists them,
/load_lora_adapter and /unload_lora_adapter change them while serving, bad adapters answer 400 naming the problem."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from lora_fixtures import reference_tokens, write_adapters
from server_harness import running_server

NEW = 5
PROMPTS = [[5, 17, 3, 42, 9, 11, 28, 7, 1, 30, 2, 64], [8, 19, 23, 4, 6, 50, 13, 21, 77, 3]]


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory):
    checkpoint = tiny_checkpoints["kimi_k3"]
    adapters = write_adapters(checkpoint, tmp_path_factory.mktemp("adapters"))
    with running_server(str(checkpoint), {"lora_paths": [f"a1={adapters['a1']}"]}) as (url, name):
        with httpx.Client(base_url=url, timeout=60) as http:
            yield http, name, checkpoint, adapters


def _generate(http, input_ids, lora_path=None, new=NEW):
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}}
    if lora_path is not None:
        body["lora_path"] = lora_path
    return http.post("/generate", json=body)


def test_models_lists_the_base_and_its_adapters(setup):
    http, name, _, adapters = setup
    data = http.get("/v1/models").json()["data"]
    assert [d["id"] for d in data] == [name, "a1"]
    assert data[1]["root"] == str(adapters["a1"]) and data[1]["parent"] == name


def test_generate_batch_mixing_base_and_adapter_matches_the_reference(setup):
    http, _, checkpoint, adapters = setup
    r = _generate(http, PROMPTS, [None, "a1"])
    assert r.status_code == 200, r.text
    got = [out["output_ids"] for out in r.json()]
    assert got[0] == reference_tokens(checkpoint, None, PROMPTS[0], NEW)
    assert got[1] == reference_tokens(checkpoint, adapters["a1"], PROMPTS[1], NEW)
    assert got[1] != reference_tokens(checkpoint, None, PROMPTS[1], NEW)  # the adapter matters here


def test_openai_model_name_selects_the_adapter(setup):
    http, name, _, _ = setup
    body = {"prompt": PROMPTS[1], "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    answer = http.post("/v1/completions", json=body | {"model": "a1"}).json()
    assert answer["choices"][0]["text"] == _generate(http, PROMPTS[1], "a1").json()["text"]
    assert answer["model"] == "a1"  # the response names the adapter that answered, as vLLM's does
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat | {"model": "a1"}).json()["model"] == "a1"
    stream = http.post("/v1/chat/completions", json=chat | {"model": "a1", "stream": True}).text
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"a1"}
    assert http.post("/v1/completions", json=body).json()["model"] == name
    missing = http.post("/v1/completions", json=body | {"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_load_and_unload_while_serving(setup, tmp_path):
    http, _, checkpoint, adapters = setup
    r = _generate(http, PROMPTS[0], "a2")
    assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"]
    r = http.post("/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2"])})
    assert r.status_code == 200, r.text
    assert r.json()["success"] and set(r.json()["loaded_adapters"]) == {"a1", "a2"}
    got = _generate(http, PROMPTS[0], "a2").json()["output_ids"]
    assert got == reference_tokens(checkpoint, adapters["a2"], PROMPTS[0], NEW)
    assert "a2" in [d["id"] for d in http.get("/v1/models").json()["data"]]
    assert http.post("/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    assert "a2" not in [d["id"] for d in http.get("/v1/models").json()["data"]]
    assert _generate(http, PROMPTS[0], "a2").status_code == 400
    # Bad adapters: a 400 naming the problem, and the server keeps serving.
    r = http.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "missing adapter_config.json" in r.json()["error"]["message"]
    (tmp_path / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 4}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    r = http.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "unreadable adapter_model.safetensors" in r.json()["error"]["message"]
    assert http.post("/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 400
    assert _generate(http, PROMPTS[0], "a1").status_code == 200


def test_load_and_unload_during_traffic_lose_no_request(setup):
    """Adapter changes between engine steps while requests of the base and of a1 are decoding."""
    from concurrent.futures import ThreadPoolExecutor

    http, _, checkpoint, adapters = setup
    long = 48  # long enough that the adapter changes land while these decode
    want = {lo: reference_tokens(checkpoint, adapters.get(lo), PROMPTS[0], long) for lo in (None, "a1")}

    def one(lo):
        with httpx.Client(base_url=str(http.base_url), timeout=60) as c:
            return lo, _generate(c, PROMPTS[0], lo, long)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, lo) for lo in [None, "a1"] * 6]
        load = {"lora_name": "a2", "lora_path": str(adapters["a2"])}
        deadline = time.monotonic() + 10
        while not http.get("/get_server_info").json()["internal_states"][0]["running"] and time.monotonic() < deadline:
            time.sleep(0.005)
        for _ in range(3):
            assert http.post("/load_lora_adapter", json=load).is_success
            assert http.post("/unload_lora_adapter", json={"lora_name": "a2"}).is_success
        for f in futures:
            lo, r = f.result()
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want[lo]
