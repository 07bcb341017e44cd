"""`kestrel bench serve`: the AgentX workload generator, and a tiny sweep against a real server over HTTP."""

from __future__ import annotations

import json
import socket

import pytest
from server_harness import running_server

from kestrel.bench.agentx import BenchConfig, Workload, make_session, request_body, run_bench, write_results
from kestrel.cli import main

# A few words per message and a few output tokens per turn: the whole sweep takes seconds on one CPU thread.
TINY = Workload(
    turns=2,
    system_tokens=16,
    tool_tokens_min=4,
    tool_tokens_max=8,
    output_tokens_median=6,
    min_output_tokens=4,
    max_output_tokens=8,
)
TINY_FLAGS = [
    "--turns", "2", "--system-tokens", "16", "--tool-tokens-min", "4", "--tool-tokens-max", "8",
    "--output-tokens-median", "6", "--min-output-tokens", "4", "--max-output-tokens", "8",
]  # fmt: skip
LEVEL_KEYS = {
    "concurrency", "sessions", "requests", "errors", "wall_s", "output_tokens", "throughput_tok_s", "ttft_p50_s",
    "ttft_p90_s", "itl_p50_s", "itl_p90_s", "speed_p50_tok_s", "speed_p90_tok_s", "mean_prompt_tokens", "meets_slo",
    "prefix_cache_hit_rate",
}  # fmt: skip


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    from kestrel.models.checkpoint import make_model

    checkpoint = make_model("kimi_k3", "tiny", tmp_path_factory.mktemp("bench") / "k3", seed=0)
    with running_server(str(checkpoint)) as (url, _):
        yield url


def test_workload_is_a_function_of_the_seed():
    default = Workload()
    a = [make_session(7, i, default) for i in range(8)]
    assert a == [make_session(7, i, default) for i in range(8)]
    assert a != [make_session(8, i, default) for i in range(8)]
    assert len({s.system for s in a}) == 1 and len(a[0].system.split()) >= default.system_tokens
    replies = ["first reply", "second reply", "third reply"]
    for turn in range(default.turns):
        body = request_body(a[3], turn, replies, "m")
        assert body == request_body(make_session(7, 3, default), turn, replies, "m")
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
        assert body["max_tokens"] == body["min_tokens"] == a[3].turns[turn].max_tokens
        assert [m["role"] for m in body["messages"]] == ["system"] + ["user", "assistant"] * turn + ["user"]
        assert [m["content"] for m in body["messages"][2::2]] == replies[:turn]
    tools = [len(t.user.split()) for s in a for t in s.turns]
    assert min(tools) >= default.tool_tokens_min and max(tools) <= default.tool_tokens_max + 20
    outs = sorted(t.max_tokens for i in range(200) for t in make_session(1, i, default).turns)
    assert default.min_output_tokens <= outs[0] and outs[-1] <= default.max_output_tokens
    assert 100 <= outs[len(outs) // 2] <= 220  # median ~150, with a long tail
    assert outs[int(0.9 * len(outs))] > 2.5 * outs[len(outs) // 2]


def check_result(result: dict, levels: list[int], out_dir) -> None:
    data = json.loads((out_dir / "bench_serve.json").read_text())
    assert data == json.loads(json.dumps(result))
    assert {"benchmark", "config", "levels", "requests", "max_concurrency_meeting_slo"} <= data.keys()
    assert [lv["concurrency"] for lv in data["levels"]] == levels
    for lv in data["levels"]:
        assert LEVEL_KEYS <= lv.keys()
        assert lv["errors"] == 0 and lv["requests"] == lv["concurrency"] * TINY.turns, lv
        for key in ("wall_s", "throughput_tok_s", "ttft_p50_s", "ttft_p90_s", "itl_p50_s", "speed_p50_tok_s"):
            assert lv[key] > 0, key
        assert lv["output_tokens"] == sum(
            r["max_tokens"] for r in data["requests"] if r["concurrency"] == lv["concurrency"]
        )
    assert all(r["output_tokens"] == r["max_tokens"] and r["ttft"] > 0 for r in data["requests"])
    # Second turns extend the first: Kestrel's prefix cache reports reused tokens, and the level summary sees them.
    assert any(r["turn"] == 1 and r["cached_tokens"] > 0 for r in data["requests"])
    assert all(0 <= lv["prefix_cache_hit_rate"] < 1 for lv in data["levels"])
    png = (out_dir / "bench_serve.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_sweep_python_entry_point(server_url, tmp_path):
    cfg = BenchConfig(server_url + "/v1", [1, 2], seed=3, workload=TINY, slo_ttft_p90=60.0, slo_speed_p90=0.01)
    result = run_bench(cfg)
    write_results(result, tmp_path)
    check_result(result, [1, 2], tmp_path)
    assert result["max_concurrency_meeting_slo"] == 2
    assert result["config"]["model"]  # found through /v1/models
    # Turn 2 carries turn 1's reply: the prompt grows within a session.
    by_turn = {(r["session"], r["turn"]): r["prompt_tokens"] for r in result["requests"]}
    assert all(by_turn[(s, 1)] > by_turn[(s, 0)] for s, _ in by_turn)


def test_sweep_through_the_cli(server_url, tmp_path, capsys):
    argv = ["bench", "serve", "--base-url", server_url, "--concurrency", "1,2", "--seed", "3", "--out", str(tmp_path)]
    assert main(argv + TINY_FLAGS + ["--slo-ttft-p90", "1e-9"]) == 0
    printed = capsys.readouterr().out
    assert "throughput" in printed and "largest concurrency meeting the SLO" in printed and ": none" in printed
    check_result(json.loads((tmp_path / "bench_serve.json").read_text()), [1, 2], tmp_path)


def test_server_errors_are_counted_not_raised(server_url):
    result = run_bench(BenchConfig(server_url, [2], model="no-such-model", workload=TINY, progress=False))
    (level,) = result["levels"]
    assert level["errors"] == level["requests"] == 2  # each session stops at its failed first turn
    assert all(r["status"] == 404 and "HTTP 404" in r["error"] for r in result["requests"])


def test_unreachable_server_is_a_one_line_error_and_a_nonzero_exit(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed when the block ends: nothing listens there
    argv = ["bench", "serve", "--base-url", url + "/v1", "--concurrency", "1", "--out", str(tmp_path)]
    assert main(argv + TINY_FLAGS) != 0
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and lines[0].startswith("error:"), captured
    assert not (tmp_path / "bench_serve.json").exists()
