"""SGLang's own router (sglang-router, the `router` extra) in front of two `kestrel serve` workers."""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

import httpx
import pytest
from process_harness import free_port, start, stop

pytest.importorskip("sglang_router", reason="sglang-router not installed: pip install -e '.[router]'")

MODEL = "kestrel-mini"  # the embedded model `kestrel serve` runs when given none
WORKER_FLAGS = ("--device", "cpu", "--max-total-tokens", "4096", "--max-model-len", "1024")
SYSTEM = "You are a careful assistant who answers briefly and checks every step twice. " * 3


@contextlib.contextmanager
def _worker(tmp_path: Path, name: str):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kestrel.cli", "serve", "--port", str(port), *WORKER_FLAGS]
    proc = start(cmd, tmp_path / f"{name}.log", url + "/health")
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            assert stop(proc) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]


@contextlib.contextmanager
def _router(tmp_path: Path, name: str, policy: str, *workers: str, extra: tuple[str, ...] = ()):
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--worker-urls", *workers, "--policy", policy, "--prometheus-port", str(free_port()), *extra]
    proc = start(cmd, tmp_path / f"{name}.log", f"http://127.0.0.1:{port}/health")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc, signal.SIGTERM)


def _chat(url: str, messages: list[dict], max_tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def _finished(worker_url: str) -> float:
    """Requests this worker finished, from its /metrics."""
    lines = httpx.get(worker_url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("kestrel_requests_finished_total"))


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    with _worker(tmp, "w0") as (_, a), _worker(tmp, "w1") as (_, b):
        yield tmp, [a, b]


def test_cache_aware_router_keeps_a_multi_turn_session_on_one_worker_and_its_prefix_hits(workers):
    tmp, urls = workers
    with _router(tmp, "router_cache_aware", "cache_aware", *urls) as router:
        messages = [{"role": "system", "content": SYSTEM}]
        before = [_finished(u) for u in urls]
        cached = []
        for turn in range(4):
            messages.append({"role": "user", "content": f"Turn {turn}: what is {turn} plus {turn}?"})
            r = _chat(router, messages)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["model"] == MODEL and out["choices"][0]["finish_reason"] in ("length", "stop")
            cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or "ok"})
        served = [_finished(u) - b for u, b in zip(urls, before, strict=True)]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    assert sorted(served) == [0, 4], served  # every turn went to the same worker


def test_round_robin_router_reaches_both_workers(workers):
    tmp, urls = workers
    with _router(tmp, "router_round_robin", "round_robin", *urls) as router:
        before = [_finished(u) for u in urls]
        for i in range(4):
            r = _chat(router, [{"role": "user", "content": f"Say {i}."}])
            assert r.status_code == 200, r.text
        served = [_finished(u) - b for u, b in zip(urls, before, strict=True)]
    assert served == [2, 2], served


def test_router_keeps_answering_after_a_worker_is_killed(workers, tmp_path):
    """SIGKILL one of two workers: the router retries on the survivor, its health check drops the dead one, and
    the survivor leaks no pages or state slots."""
    _, urls = workers
    fast = ("--retry-max-retries", "3", "--retry-initial-backoff-ms", "50", "--retry-max-backoff-ms", "200")
    fast += ("--health-check-interval-secs", "1", "--health-failure-threshold", "1")
    with _worker(tmp_path, "victim") as (victim, victim_url):
        with _router(tmp_path, "router_failover", "round_robin", urls[0], victim_url, extra=fast) as router:
            for i in range(2):
                assert _chat(router, [{"role": "user", "content": f"Warm {i}."}]).status_code == 200
            victim.kill()
            victim.wait(10)
            before = _finished(urls[0])
            statuses = []
            for i in range(6):
                statuses.append(_chat(router, [{"role": "user", "content": f"After {i}."}]).status_code)
            survivor_served = _finished(urls[0]) - before
            # Idle again: every page and state slot the survivor used is free or held by its prefix cache.
            stats = httpx.get(urls[0] + "/get_server_info", timeout=10).json()["internal_states"][0]
    assert statuses == [200] * 6, statuses
    assert survivor_served == 6, survivor_served
    assert stats["running"] == stats["waiting"] == 0 and stats["pages_used"] == 0 and stats["slots_used"] == 0
