"""SGLang's weight/adapter sync API over a real HTTP server: pause_generation (abort | retract | in_place),
update_weights_from_disk, continue_generation, weight versions and adapter upserts. Every request must come back
whole and entirely on one version: its meta_info says which, and its tokens equal what that version alone produces
(the reference path on that checkpoint, adapter included)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
from lora_fixtures import reference_tokens, write_adapters
from safetensors.torch import load_file, save_file
from server_harness import running_server

from kestrel.models.checkpoint import make_model

PROMPTS = [[(7 * i + 3 * j) % 200 + 1 for j in range(6 + i % 5)] for i in range(16)]
LONG = 24  # decoding long enough that the sync lands while every request is mid-stream


@dataclass
class Sync:
    """The server, its two checkpoints (A and B: one architecture, different weights), the adapters, and which
    checkpoint each weight version named."""

    http: httpx.Client
    ckpts: dict[str, Path]
    adapters: dict[str, Path]
    versions: dict[str, str] = field(default_factory=lambda: {"v0": "A"})
    current: str = "v0"
    _names: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _refs: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return str(self.http.base_url)

    def other(self) -> str:
        """The checkpoint not serving now."""
        return "B" if self.versions[self.current] == "A" else "A"

    def update(self, ckpt: str, client: httpx.Client | None = None) -> dict:
        version = f"v{next(self._names)}"
        self.versions[version] = ckpt
        body = {"model_path": str(self.ckpts[ckpt]), "weight_version": version}
        answer = post_ok(client or self.http, "/update_weights_from_disk", body)
        self.current = version
        return answer

    def ref(self, prompt: list[int], new: int, version: str | None = None, adapter: str | None = None) -> list[int]:
        """Greedy tokens of the reference path on the checkpoint `version` names (default: the current one)."""
        key = (self.versions[version or self.current], tuple(prompt), new, adapter)
        if key not in self._refs:
            self._refs[key] = reference_tokens(self.ckpts[key[0]], self.adapters.get(adapter), prompt, new)
        return self._refs[key]


@pytest.fixture(scope="module")
def sync(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    a = tiny_checkpoints["kimi_k3"]
    ckpts = {"A": a, "B": make_model("kimi_k3", "tiny", root / "b", seed=4)}
    adapters = write_adapters(a, root / "adapters")  # they fit both checkpoints
    engine = {"weight_version": "v0", "lora_paths": [f"pol={adapters['a1']}"]}
    with running_server(str(a), engine) as (url, _):
        with httpx.Client(base_url=url, timeout=120) as http:
            yield Sync(http, ckpts, adapters)


def _body(prompt, new, stream=False, lora=None):
    body = {"input_ids": prompt, "stream": stream}
    body["sampling_params"] = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    return body | ({"lora_path": lora} if lora else {})


def stream(url: str, prompt, new, started: threading.Event | None = None, lora=None) -> list[dict]:
    """Every chunk of a streamed /generate (cumulative results); `started` is set at the first one."""
    chunks = []
    body = _body(prompt, new, True, lora)
    with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                if started is not None:
                    started.set()
    return chunks


def stream_completion(url: str, prompt, new, started: threading.Event) -> list[dict]:
    """An OpenAI streamed /v1/completions: its chunks (it cannot take back text it sent)."""
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                started.set()
    return chunks


def runs(chunks: list[dict]) -> list[list[dict]]:
    """The stream cut where it starts over (a retracted request's next chunk is not an extension of the last)."""
    out: list[list[dict]] = []
    for c in chunks:
        prev = out[-1][-1]["output_ids"] if out else None
        if prev is None or c["output_ids"][: len(prev)] != prev:
            out.append([])
        out[-1].append(c)
    return out


def one_version(chunks: list[dict]) -> str:
    """The final run's version; every chunk of a run names the same one."""
    for run in runs(chunks):
        assert len({c["meta_info"]["weight_version"] for c in run}) == 1, run
    return chunks[-1]["meta_info"]["weight_version"]


def state(http) -> dict:
    return http.get("/get_server_info").json()["internal_states"][0]


def wait_running(http, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while state(http)["running"] < n:
        assert time.monotonic() < deadline, "requests did not start"
        time.sleep(0.005)


def assert_nothing_held(http) -> None:
    """Every page and state slot back (the counters follow the last step's events by a moment)."""
    deadline = time.monotonic() + 5
    while (s := state(http)) and (s["running"], s["waiting"], s["pages_used"], s["slots_used"]) != (0, 0, 0, 0):
        assert time.monotonic() < deadline, s
        time.sleep(0.01)


def post_ok(http, path, body=None):
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@contextlib.contextmanager
def paused(http, mode: str):
    """pause_generation(mode) ... continue_generation, which also runs if an assert fails in between (else the
    paused streams would wait for their read timeout)."""
    answer = post_ok(http, "/pause_generation", {"mode": mode})
    try:
        yield answer
    finally:
        post_ok(http, "/continue_generation")


def test_sync_under_load_retract_reruns_each_request_whole_on_the_new_weights(sync):
    """16 streams on v_old; pause(retract) → update_weights_from_disk → continue: each one completes on one
    version, its tokens those of that version alone."""
    http, old = sync.http, sync.current
    events = [threading.Event() for _ in range(len(PROMPTS) + 1)]
    with ThreadPoolExecutor(17) as pool:
        futures = [pool.submit(stream, sync.url, p, LONG, e) for p, e in zip(PROMPTS, events)]
        openai = pool.submit(stream_completion, sync.url, PROMPTS[0], LONG, events[-1])
        assert all(e.wait(60) for e in events)  # every request is streaming on the old weights
        with paused(http, "retract") as answer:
            assert answer["status"] == "ok" and answer["num_retracted_requests"] >= 12
            info = http.get("/get_server_info").json()
            assert info["paused"] == "retract"
            s = info["internal_states"][0]
            assert (s["running"], s["pages_used"], s["slots_used"]) == (0, 0, 0)  # retracted: pages, slots freed
            answer = sync.update(sync.other())
            new = sync.current
            assert answer["success"] and answer["num_paused_requests"] >= 12 and answer["weight_version"] == new
        results = [f.result() for f in futures]
        # An OpenAI stream cannot take back the text it sent: retracted, it ends with finish_reason "abort".
        assert [c["choices"][0]["finish_reason"] for c in openai.result()][-1] == "abort"
    assert sum(sync.ref(p, LONG, old) != sync.ref(p, LONG, new) for p in PROMPTS) >= 12  # the versions differ
    retracted = 0
    for prompt, chunks in zip(PROMPTS, results):
        final = chunks[-1]
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
        version = one_version(chunks)
        assert final["output_ids"] == sync.ref(prompt, LONG, version)  # every token from that version alone
        if len(runs(chunks)) > 1:
            retracted += 1
            assert version == new and runs(chunks)[0][0]["meta_info"]["weight_version"] == old
    assert retracted >= 12
    assert http.get("/get_weight_version").json() == {"weight_version": new}
    assert http.get("/weight_version").json() == {"weight_version": new}
    assert http.get("/get_model_info").json()["weight_version"] == new
    assert http.get("/get_server_info").json()["weight_version"] == new
    assert_nothing_held(http)


def test_update_while_generating_lets_started_requests_finish_on_the_old_weights(sync):
    """No pause: the update waits until the started requests finish (on the old weights); requests sent
    meanwhile are held back and run on the new ones."""
    http, old = sync.http, sync.current
    with ThreadPoolExecutor(8) as pool:
        early = [pool.submit(stream, sync.url, p, 3 * LONG) for p in PROMPTS[:4]]
        wait_running(http, 4)
        client = httpx.Client(base_url=sync.url, timeout=120)
        answer = pool.submit(sync.update, sync.other(), client)  # lands while the four decode
        deadline = time.monotonic() + 30
        while not state(http)["pending_weight_updates"]:  # waiting for the started ones
            assert not answer.done() and time.monotonic() < deadline
            time.sleep(0.002)
        late = [pool.submit(stream, sync.url, p, 8) for p in PROMPTS[4:6]]
        assert answer.result()["success"]
        for prompt, f in zip(PROMPTS[:4], early):
            chunks = f.result()
            assert len(runs(chunks)) == 1 and one_version(chunks) == old
            assert chunks[-1]["output_ids"] == sync.ref(prompt, 3 * LONG, old)
        for prompt, f in zip(PROMPTS[4:6], late):
            chunks = f.result()
            assert one_version(chunks) == sync.current and chunks[-1]["output_ids"] == sync.ref(prompt, 8)
    assert_nothing_held(http)


def test_pause_abort_ends_running_requests_and_new_ones_wait_for_continue(sync):
    http = sync.http
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(stream, sync.url, p, LONG) for p in PROMPTS[:4]]
        wait_running(http, 4)
        with paused(http, "abort") as answer:
            assert answer["num_aborted_requests"] == 4
            for f in running:
                assert f.result()[-1]["meta_info"]["finish_reason"] == {"type": "abort"}
            queued = pool.submit(stream, sync.url, PROMPTS[5], 6)
            time.sleep(0.3)
            s = state(http)
            assert not queued.done() and (s["running"], s["waiting"]) == (0, 1)  # queued while paused
        chunks = queued.result()
        assert one_version(chunks) == sync.current and chunks[-1]["output_ids"] == sync.ref(PROMPTS[5], 6)
    assert_nothing_held(http)


def test_pause_in_place_freezes_requests_and_an_update_reruns_them(sync):
    http, old = sync.http, sync.current
    with ThreadPoolExecutor(8) as pool:
        kept = [pool.submit(stream, sync.url, p, LONG) for p in PROMPTS[:2]]
        wait_running(http, 2)
        with paused(http, "in_place"):
            before = state(http)
            time.sleep(0.2)
            after = state(http)
            assert before["running"] == after["running"] == 2
            assert before["computed_tokens"] == after["computed_tokens"]  # not a step ran
        for prompt, f in zip(PROMPTS[:2], kept):  # resumed where they stood: one run, the same weights
            chunks = f.result()
            assert len(runs(chunks)) == 1 and one_version(chunks) == old
            assert chunks[-1]["output_ids"] == sync.ref(prompt, LONG)
        # An update while paused in place: their KV is the old weights', so they rerun whole on the new ones.
        rerun = [pool.submit(stream, sync.url, p, LONG) for p in PROMPTS[2:4]]
        wait_running(http, 2)
        with paused(http, "in_place"):
            assert sync.update(sync.other())["success"]
        for prompt, f in zip(PROMPTS[2:4], rerun):
            chunks = f.result()
            assert len(runs(chunks)) == 2 and one_version(chunks) == sync.current
            assert chunks[-1]["output_ids"] == sync.ref(prompt, LONG)
    assert_nothing_held(http)


def test_update_weight_version_renames_the_weights(sync):
    http, ckpt = sync.http, sync.versions[sync.current]
    r = post_ok(http, "/update_weight_version", {"new_version": "renamed"})
    assert r == {"success": True, "message": "Weight version updated to renamed", "new_version": "renamed"}
    sync.versions["renamed"], sync.current = ckpt, "renamed"
    out = post_ok(http, "/generate", _body(PROMPTS[0], 4))
    assert out["meta_info"]["weight_version"] == "renamed" and out["output_ids"] == sync.ref(PROMPTS[0], 4)


def test_bad_weights_are_refused_naming_the_problem_and_change_nothing(sync, tiny_checkpoints, tmp_path):
    http, a = sync.http, sync.ckpts["A"]
    wrong_shape = tmp_path / "wrong_shape"
    shutil.copytree(a, wrong_shape)
    file = next(wrong_shape.glob("*.safetensors"))
    tensors = load_file(file)
    name = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
    save_file(tensors, file)
    truncated = tmp_path / "truncated"
    shutil.copytree(a, truncated)
    bad = next(truncated.glob("*.safetensors"))
    bad.write_bytes(bad.read_bytes()[:100])
    cases = [
        ({"model_path": str(tmp_path / "missing")}, "model_path", "no config.json"),
        ({"model_path": str(tiny_checkpoints["deepseek_v32"])}, "model_path", "another architecture: model_type"),
        ({"model_path": str(wrong_shape)}, "model_path", f"shape mismatches (1): {name}"),
        ({"model_path": str(truncated)}, "model_path", "unreadable"),
        ({"model_path": str(a), "load_format": "pt"}, "load_format", "not supported"),
        ({"model_path": str(a), "flush_cache": False}, "flush_cache", "must be true"),
    ]
    for body, param, words in cases:
        r = http.post("/update_weights_from_disk", json=body | {"weight_version": "bad"})
        assert r.status_code == 400, r.text
        answer = r.json()
        assert answer["success"] is False and words in answer["message"], answer
        assert answer["error"]["param"] == param and words in answer["error"]["message"]
    assert http.post("/pause_generation", json={"mode": "sideways"}).status_code == 400
    assert http.get("/get_weight_version").json() == {"weight_version": sync.current}  # the old weights serve
    assert post_ok(http, "/generate", _body(PROMPTS[1], 6))["output_ids"] == sync.ref(PROMPTS[1], 6)
    assert_nothing_held(http)


def test_adapter_upsert_during_traffic_finishes_old_requests_on_the_old_version(sync, tmp_path):
    """`pol` is a1 (version 1); an upsert swaps in a2's files as version 2 while pol's requests decode: they finish
    on version 1, requests sent after it run on version 2, and none is lost."""
    http, adapters, pol = sync.http, sync.adapters, PROMPTS[6:8]
    again = {"lora_name": "pol", "lora_path": str(adapters["a1"]), "replace": True, "lora_version": "1"}
    checksum = post_ok(http, "/load_lora_adapter", again)["adapter"]["checksum"]
    assert checksum == hashlib.sha256((adapters["a1"] / "adapter_model.safetensors").read_bytes()).hexdigest()
    a2_sum = hashlib.sha256((adapters["a2"] / "adapter_model.safetensors").read_bytes()).hexdigest()
    with ThreadPoolExecutor(8) as pool:
        old = [pool.submit(stream, sync.url, p, LONG, None, "pol") for p in pol]
        base = pool.submit(stream, sync.url, PROMPTS[8], LONG)
        wait_running(http, 3)
        bad = {"lora_name": "pol", "lora_path": str(adapters["a2"]), "replace": True, "checksum": "0" * 64}
        r = http.post("/load_lora_adapter", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "checksum" and a2_sum in r.text
        r = http.post("/load_lora_adapter", json={"lora_name": "pol", "lora_path": str(adapters["a2"])})
        assert r.status_code == 400 and "already loaded" in r.text  # no replace: refused
        upsert = {"lora_name": "pol", "lora_path": str(adapters["a2"]), "replace": True, "lora_version": "2"}
        got = post_ok(http, "/load_lora_adapter", upsert | {"checksum": f"sha256:{a2_sum}"})
        assert got["adapter"] == {"lora_name": "pol", "lora_path": str(adapters["a2"]), "lora_version": "2"} | {
            "checksum": a2_sum
        }
        assert state(http)["running"] == 3  # the upsert landed while they decode
        new = [pool.submit(stream, sync.url, p, 8, None, "pol") for p in pol]
        for prompt, f in zip(pol, old):
            chunks = f.result()
            assert len(runs(chunks)) == 1 and chunks[-1]["output_ids"] == sync.ref(prompt, LONG, adapter="a1")
            assert {c["meta_info"]["lora_version"] for c in chunks} == {"1"}
            assert chunks[-1]["meta_info"]["lora_checksum"] == checksum
        for prompt, f in zip(pol, new):
            final = f.result()[-1]
            assert (
                final["output_ids"] == sync.ref(prompt, 8, adapter="a2") and final["meta_info"]["lora_version"] == "2"
            )
            assert final["meta_info"]["lora_checksum"] == a2_sum
        assert base.result()[-1]["output_ids"] == sync.ref(PROMPTS[8], LONG)
        assert "lora_version" not in base.result()[-1]["meta_info"]
    assert [sync.ref(p, LONG, adapter="a1") for p in pol] != [sync.ref(p, LONG, adapter="a2") for p in pol]
    assert http.get("/get_server_info").json()["lora_adapters"]["pol"]["lora_version"] == "2"
    assert [d["id"] for d in http.get("/v1/models").json()["data"]][1:] == ["pol"]  # the retired version is gone
    # Bad adapters: a 400 naming the problem; version 2 keeps serving.
    (tmp_path / "adapter_config.json").write_text((adapters["a1"] / "adapter_config.json").read_text())
    tensors = load_file(adapters["a1"] / "adapter_model.safetensors")
    key = next(iter(tensors))
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    for path, words in ((tmp_path, "expected"), (tmp_path / "nowhere", "missing adapter_config.json")):
        r = http.post("/load_lora_adapter", json={"lora_name": "pol", "lora_path": str(path), "replace": True})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert http.get("/get_server_info").json()["lora_adapters"]["pol"]["lora_version"] == "2"
    assert post_ok(http, "/generate", _body(pol[0], 8, lora="pol"))["output_ids"] == sync.ref(pol[0], 8, adapter="a2")
    assert_nothing_held(http)


def test_retracted_requests_rerun_from_scratch_to_the_tokens_of_a_fresh_run(tiny_checkpoints):
    """Engine level: retract_all frees every page and slot and forgets every per-token record (a field added to
    Request later included), and a seeded sampled request reruns to exactly what it gives alone."""
    from dataclasses import fields

    from kestrel.engine.llm import LLM
    from kestrel.engine.sampling_params import SamplingParams

    llm = LLM(str(tiny_checkpoints["kimi_k3"]), max_total_tokens=2048, max_model_len=256)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[:3]]
    free_pages, free_slots = engine.pages.num_free, engine.slots.num_free
    ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    for _ in range(5):
        engine.step()
    with pytest.raises(ValueError, match="started on the current weights"):
        engine.update_weights_from_disk(str(tiny_checkpoints["kimi_k3"]))
    retracted = engine.retract_all()
    assert len(retracted) == 3 and not engine.started_requests()
    assert (engine.pages.num_free, engine.slots.num_free) == (free_pages, free_slots)  # nothing committed or held
    for req in retracted:
        lists = [f.name for f in fields(req) if isinstance(getattr(req, f.name), list) and f.name != "prompt_ids"]
        assert all(not getattr(req, name) for name in lists), lists
        assert req.output_text == "" and req.weight_version is None and req.computed_len == 0
    done = {}
    while engine.has_unfinished:
        done |= {o.request_id: o for o in engine.step().finished}
    assert [done[i].outputs[0].token_ids for i in ids] == alone
    assert {done[i].outputs[0].weight_version for i in ids} == {"default"}
