"""1P1D behind the real sglang-router in PD mode: two `kestrel serve` processes (prefill, decode) moving KV over
Mooncake on loopback, compared token for token with a unified `kestrel serve`; and the faults: a prefill worker
killed mid-transfer, a decode worker restarted. Every worker stops cleanly (exit 0, no traceback)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from process_harness import free_port, kestrel_serve, router_cmd, spawn, start, stop, wait_healthy
from server_harness import running_server

pytestmark = pytest.mark.timeout(300)

FLAGS = ("--device", "cpu", "--max-total-tokens", "4096", "--max-model-len", "1024", "--max-running-requests", "8")
MINI = "kestrel-mini"
SYSTEM = "You are a careful assistant who answers briefly and checks every step twice. " * 3
# A prefill worker whose sender stalls after writing the KV, before the status word: killed there, it dies
# mid-transfer. The fault is injected from the test; the worker's code is the shipped one.
STALLING_PREFILL = """
import sys, time
from kestrel.disagg import prefill
from kestrel.disagg.messages import TransferState
write_head = prefill.PrefillRole._write_head
def stalled(self, room, state):
    if state == TransferState.SUCCESS:
        time.sleep(120)
    write_head(self, room, state)
prefill.PrefillRole._write_head = stalled
from kestrel.cli import main
sys.exit(main(sys.argv[1:]))
"""


@dataclass
class Worker:
    name: str
    proc: object
    url: str
    log: Path
    bootstrap_port: int | None = None
    stop_signal: int = signal.SIGINT

    def stats(self) -> dict:
        return httpx.get(self.url + "/get_server_info", timeout=10).json()["internal_states"][0]

    def metric(self, name: str, labels: str = "") -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + labels + " ") or line.startswith(name + labels + "{") and not labels:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def close(self) -> None:
        """Stop with one signal: exit code 0 and no traceback in the log."""
        code = stop(self.proc, self.stop_signal)
        text = self.log.read_text()
        assert code == 0 and "Traceback" not in text, f"{self.name} exited {code}:\n{text[-4000:]}"


def spawn_worker(tmp: Path, name: str, mode: str, model: str | None, *extra: str, launcher: str | None = None):
    port = free_port()
    flags = [*FLAGS, "--disaggregation-mode", mode, *extra]
    boot = None
    if mode == "prefill":
        boot = free_port()
        flags += ["--disaggregation-bootstrap-port", str(boot)]
    cmd = kestrel_serve(port, *([model] if model else []), *flags, launcher=launcher)
    log = tmp / f"{name}.log"
    stop_signal = signal.SIGTERM if mode == "decode" else signal.SIGINT  # both signals are tested
    return Worker(name, spawn(cmd, log), f"http://127.0.0.1:{port}", log, boot, stop_signal)


def healthy(*workers: Worker) -> None:
    for w in workers:
        wait_healthy(w.proc, w.log, w.url + "/health")


@dataclass
class Stack:
    prefill: Worker
    decode: Worker
    router: str
    unified: str
    model: str
    rooms: list[int] = field(default_factory=list)


@contextlib.contextmanager
def pd_stack(tmp: Path, model: str | None, name: str):
    """Prefill + decode workers, the router in PD mode in front, and a unified server (in this process) to compare."""
    prefill = spawn_worker(tmp, f"{name}-prefill", "prefill", model)
    decode = spawn_worker(tmp, f"{name}-decode", "decode", model)
    try:
        healthy(prefill, decode)
        port = free_port()
        args = ["--pd-disaggregation", "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url]
        args += ["--prometheus-port", str(free_port())]
        router = start(router_cmd(port, *args), tmp / f"{name}-router.log", f"http://127.0.0.1:{port}/health")
        try:
            with running_server(model) as (unified, served):
                yield Stack(prefill, decode, f"http://127.0.0.1:{port}", unified, served)
        finally:
            stop(router, signal.SIGTERM)
    finally:
        for w in (decode, prefill):
            if w.proc.poll() is None:
                w.close()


def assert_idle(*workers: Worker) -> None:
    """Nothing running, no page or slot held outside the prefix cache, no room or transfer left."""
    for w in workers:
        deadline = time.monotonic() + 20
        while True:
            s = w.stats()
            busy = s["running"] + s["waiting"] + s["pages_used"] + s["slots_used"]
            busy += s.get("disagg_rooms", 0) + s.get("disagg_transfers", 0) + s.get("disagg_pending", 0)
            if busy == 0:
                break
            assert time.monotonic() < deadline, f"{w.name} still holds something: {s}"
            time.sleep(0.1)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def chat(url: str, model: str, messages: list[dict], max_tokens: int = 12, **extra) -> httpx.Response:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    return post(url, "/v1/chat/completions", body)


def stream_deltas(url: str, path: str, body: dict) -> list[dict]:
    """The `choices[0]` of every SSE chunk of a streamed response."""
    chunks = []
    with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payload = json.loads(line[6:])
                assert "error" not in payload, payload
                chunks += payload["choices"]
    return chunks


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    with pd_stack(tmp_path_factory.mktemp("pd"), None, "mini") as stack:
        yield stack


def test_chat_through_the_pd_router_equals_a_unified_worker_streamed_or_not(mini):
    messages = [{"role": "user", "content": "What is 23 plus 19?"}]
    want = chat(mini.unified, mini.model, messages).json()
    got = chat(mini.router, mini.model, messages).json()
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 12
    body = {"model": mini.model, "messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True}
    body |= {"top_logprobs": 2}
    want_chunks = stream_deltas(mini.unified, "/v1/chat/completions", body)
    got_chunks = stream_deltas(mini.router, "/v1/chat/completions", body)
    assert [c["delta"] for c in got_chunks] == [c["delta"] for c in want_chunks]  # the first token has its own chunk
    lp = [[(t["token"], t["top_logprobs"]) for t in c["logprobs"]["content"]] for c in got_chunks if c["logprobs"]]
    assert lp == [
        [(t["token"], t["top_logprobs"]) for t in c["logprobs"]["content"]] for c in want_chunks if c["logprobs"]
    ]
    assert_idle(mini.prefill, mini.decode)


def test_completions_and_generate_through_the_pd_router_equal_a_unified_worker(mini):
    body = {"model": mini.model, "prompt": "The weather in Beijing is", "max_tokens": 10, "temperature": 0}
    want, got = post(mini.unified, "/v1/completions", body).json(), post(mini.router, "/v1/completions", body).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    want_text = "".join(c["text"] for c in stream_deltas(mini.unified, "/v1/completions", body))
    assert "".join(c["text"] for c in stream_deltas(mini.router, "/v1/completions", body)) == want_text
    gen = {"text": "Count to five:", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    gen |= {"return_logprob": True, "logprob_start_len": 0}
    want, got = post(mini.unified, "/generate", gen).json(), post(mini.router, "/generate", gen).json()
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    for key in ("output_token_logprobs", "input_token_logprobs"):  # the router joins the prefill's prompt logprobs
        got_lp, want_lp = got["meta_info"][key], want["meta_info"][key]
        assert [t for _, t, _ in got_lp] == [t for _, t, _ in want_lp], key
        assert [v or 0.0 for v, _, _ in got_lp] == pytest.approx([v or 0.0 for v, _, _ in want_lp], abs=1e-6), key
    assert_idle(mini.prefill, mini.decode)


def test_a_multi_turn_session_reports_cached_tokens_and_the_decode_side_reuses_its_pages(mini):
    messages = [{"role": "system", "content": SYSTEM}]
    decode_hits = mini.decode.metric("kestrel_prefix_cache_hit_tokens", '{tier="device"}')
    cached = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Turn {turn}: what is {turn} plus {turn + 4}?"})
        want = chat(mini.unified, mini.model, messages).json()
        got = chat(mini.router, mini.model, messages).json()
        assert got["choices"][0]["message"] == want["choices"][0]["message"], turn
        cached.append(got["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages.append({"role": "assistant", "content": got["choices"][0]["message"]["content"] or "ok"})
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached  # the prefill worker's prefix hits
    # The decode worker kept the pages it received: later turns only moved their new suffix.
    assert mini.decode.metric("kestrel_prefix_cache_hit_tokens", '{tier="device"}') > decode_hits
    assert_idle(mini.prefill, mini.decode)


def test_transfer_metrics_count_bytes_latency_and_failures(mini):
    assert chat(mini.router, mini.model, [{"role": "user", "content": "Hi."}], max_tokens=2).status_code == 200
    for w in (mini.prefill, mini.decode):
        assert w.metric("kestrel_disagg_transfer_bytes_total") > 0
        assert w.metric("kestrel_disagg_transfer_latency_seconds_count") >= 1
        assert w.metric("kestrel_disagg_failed_transfers_total") == 0
    for w in (mini.prefill, mini.decode):  # each role checks itself alone, through the fake transfer
        assert httpx.get(w.url + "/health_generate", timeout=30).status_code == 200


def test_requests_a_disaggregated_worker_cannot_serve_get_a_400(mini):
    r = chat(mini.decode.url, mini.model, [{"role": "user", "content": "Hi."}])
    assert r.status_code == 400 and "bootstrap_room: required" in r.json()["error"]["message"]
    r = chat(mini.router, mini.model, [{"role": "user", "content": "Hi."}], n=2)  # the router sends two rooms
    assert r.status_code == 400, r.text
    assert_idle(mini.prefill, mini.decode)


def _half(worker: Worker, prefill: Worker, room: int, prompt: list[int], max_tokens: int = 6):
    """One half of a /generate request sent directly, as the router would, in a thread (a future of the reply)."""
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}} | boot
    return concurrent.futures.ThreadPoolExecutor(1).submit(post, worker.url, "/generate", body)


def _pair_request(prefill: Worker, decode: Worker, room: int, prompt: list[int]):
    """Both halves; the decode half's future (the reply the router would forward)."""
    reply = _half(decode, prefill, room, prompt)
    _half(prefill, prefill, room, prompt)
    return reply


def test_a_prefill_worker_killed_mid_transfer_fails_the_decode_request_and_frees_it(mini, tmp_path):
    stalling = spawn_worker(tmp_path, "stalling-prefill", "prefill", None, launcher=STALLING_PREFILL)
    healthy(stalling)
    reply = _pair_request(stalling, mini.decode, 4242, list(range(30, 90)))
    deadline = time.monotonic() + 60
    while mini.decode.stats().get("disagg_transferring", 0) == 0:  # the KV is written, the status word not yet
        assert time.monotonic() < deadline and stalling.proc.poll() is None, "the transfer never started"
        time.sleep(0.05)
    stalling.proc.kill()
    stalling.proc.wait()
    r = reply.result(60)
    assert r.status_code == 502, r.text
    assert "stopped answering mid-transfer" in r.json()["error"]["message"]
    assert mini.decode.metric("kestrel_disagg_failed_transfers_total") >= 1
    assert_idle(mini.decode)


def test_a_restarted_decode_worker_makes_the_prefill_drop_stale_rooms_then_re_handshakes(mini, tmp_path):
    prompt = list(range(40, 100))
    gen = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    want = post(mini.unified, "/generate", gen).json()["output_ids"]
    first = spawn_worker(tmp_path, "decode-1", "decode", None)
    healthy(first)
    assert _pair_request(mini.prefill, first, 5001, prompt).result(60).json()["output_ids"] == want
    instances = mini.prefill.stats()["disagg_decode_instances"]
    # Two rooms whose destinations the prefill worker holds when the decode worker dies: one whose prefill half
    # comes afterwards (its write fails), one that never gets one (dropped when a new decode instance connects).
    for room in (5002, 5003):
        _half(first, mini.prefill, room, prompt)
    deadline = time.monotonic() + 30
    while mini.prefill.stats()["disagg_rooms"] < 2:
        assert time.monotonic() < deadline, "the decode worker never registered its rooms"
        time.sleep(0.05)
    first.proc.kill()
    first.proc.wait()
    r = _half(mini.prefill, mini.prefill, 5002, prompt).result(60)
    assert r.status_code == 502 and "decode worker" in r.json()["error"]["message"], r.text
    second = spawn_worker(tmp_path, "decode-2", "decode", None)
    healthy(second)
    try:
        assert _pair_request(mini.prefill, second, 5004, prompt).result(60).json()["output_ids"] == want
        assert mini.prefill.stats()["disagg_decode_instances"] == instances  # the dead instance is gone
        assert_idle(mini.prefill, second)
    finally:
        second.close()


@pytest.mark.parametrize("family", ["kimi_k3", "deepseek_v32"])
def test_small_checkpoints_through_the_pd_router_equal_a_unified_worker(family, tmp_path):
    from kestrel.models.checkpoint import make_model

    path = str(make_model(family, "small", tmp_path / family, seed=11))
    with pd_stack(tmp_path, path, family) as stack:
        ids = list(range(5, 45))
        for turn in range(2):  # a session: the second turn extends the first (prefix hits on both sides)
            gen = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
            want, got = post(stack.unified, "/generate", gen).json(), post(stack.router, "/generate", gen).json()
            assert got["output_ids"] == want["output_ids"], turn
            if turn:
                assert got["meta_info"]["cached_tokens"] > 0
            ids = ids + got["output_ids"] + list(range(60, 80))
        body = {"model": stack.model, "prompt": "abc def", "max_tokens": 8, "temperature": 0}
        want_text = "".join(c["text"] for c in stream_deltas(stack.unified, "/v1/completions", body))
        assert "".join(c["text"] for c in stream_deltas(stack.router, "/v1/completions", body)) == want_text
        messages = [{"role": "user", "content": "hello there"}]
        want = chat(stack.unified, stack.model, messages, max_tokens=6).json()["choices"][0]["message"]
        assert chat(stack.router, stack.model, messages, max_tokens=6).json()["choices"][0]["message"] == want
        assert_idle(stack.prefill, stack.decode)
