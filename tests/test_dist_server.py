"""`kestrel serve --tp 2` and `--pp 2`: same text as one process through the OpenAI client (stream and not), SIGINT
stops every rank with exit 0, a killed or stuck rank brings the server down with a clear error instead of a hang, and
an invalid layout is refused before any rank starts."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from process_harness import kestrel_serve, start
from server_harness import running_server

from kestrel.dist.launch import free_port

PROMPTS = ["Hello there", "The quick brown fox jumps over"]
FLAGS = ("--max-total-tokens", "2048", "--max-model-len", "256", "--dist-timeout", "20")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from kestrel.models.checkpoint import make_model

    return str(make_model("kimi_k3", "tiny", tmp_path_factory.mktemp("dist_server") / "k3", seed=0))


def _serve_tp2(checkpoint: str, log_path: Path, *flags: str, layout=("--tp", "2")) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = kestrel_serve(port, checkpoint, "--device", "cpu", *layout, *FLAGS, *flags)
    return start(cmd, log_path, url + "/health", timeout=120), url


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _answers(url: str) -> list[str]:
    client = OpenAI(base_url=url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    out = []
    for prompt in PROMPTS:
        kwargs = dict(model=model, prompt=prompt, max_tokens=12, temperature=0)
        out.append(client.completions.create(**kwargs).choices[0].text)
        out.append("".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)))
    return out


@pytest.fixture(scope="module")
def one_process_answers(checkpoint):
    with running_server(checkpoint, {"max_total_tokens": 2048, "max_model_len": 256}) as (url, _):
        return _answers(url)


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_serve_answers_like_one_process_and_sigint_stops_every_rank(layout, checkpoint, one_process_answers, tmp_path):
    want = one_process_answers
    log = tmp_path / "serve.log"
    proc, url = _serve_tp2(checkpoint, log, layout=layout)
    try:
        ranks = _children(proc.pid)
        assert _answers(url) == want and all(want)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text()
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ranks and all(_gone(pid) for pid in ranks)


def _rank_process(proc: subprocess.Popen) -> int:
    return max(pid for pid in _children(proc.pid) if "spawn" in Path(f"/proc/{pid}/cmdline").read_text())


def test_killed_rank_fails_the_server_with_a_clear_error(checkpoint, tmp_path):
    log = tmp_path / "killed.log"
    proc, url = _serve_tp2(checkpoint, log)
    try:
        rank = _rank_process(proc)
        os.kill(rank, signal.SIGKILL)
        start = time.monotonic()
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 1 and time.monotonic() - start < 30
    assert "rank 1 exited with code -9; every rank was stopped" in log.read_text()


def test_stuck_rank_times_out_the_step_and_stops_the_server(checkpoint, tmp_path):
    """A rank that hangs (SIGSTOP) is not dead: the step's collective times out (--dist-timeout), the request gets
    an error, and the server stops every rank and exits 1."""
    log = tmp_path / "stuck.log"
    proc, url = _serve_tp2(checkpoint, log, "--dist-timeout", "5")
    rank = _rank_process(proc)
    try:
        os.kill(rank, signal.SIGSTOP)
        start = time.monotonic()
        body = {"model": checkpoint, "prompt": "hi", "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 500
        code = proc.wait(40)
        assert code == 1 and time.monotonic() - start < 40
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank, signal.SIGKILL)
    assert "Timed out" in log.read_text() and "every rank was stopped" in log.read_text()


@pytest.mark.parametrize(
    "flags, env, message",
    [
        (("--pp", "2", "--pp-partition", "3,3"), {}, "--pp-partition (or KESTREL_PP_LAYER_PARTITION): [3, 3] sums"),
        (("--pp", "2"), {"KESTREL_PP_LAYER_PARTITION": "1,1,2"}, "3 entries [1, 1, 2], needs one per stage (--pp 2)"),
        (("--pcp", "2", "--tp", "2", "--dcp", "2"), {}, "--pcp: pcp > 1 with dcp > 1 is not supported yet"),
    ],
    ids=["partition-sum", "partition-env-length", "pcp-with-dcp"],
)
def test_invalid_layout_is_refused_before_any_rank_starts(flags, env, message, checkpoint, monkeypatch, capsys):
    from kestrel.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spawned = []
    monkeypatch.setattr("kestrel.dist.launch.mp.start_processes", lambda *a, **k: spawned.append(a))
    assert main(["generate", checkpoint, "--device", "cpu", "--prompt", "hi", *flags]) == 2
    assert message in capsys.readouterr().err and not spawned
