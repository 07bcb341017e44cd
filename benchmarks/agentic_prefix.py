"""Multi-turn agent replay with the prefix cache on vs off, in one run: prefill tokens computed and TTFT.

Each session starts from a long history (a shared system prompt plus its own context) and, turn after turn,
appends its last answer and 100–300 new prompt tokens (a tool result, a user message), then asks for 64 new
tokens. Sessions run concurrently in a closed loop: a session's next turn is submitted when its previous one
finishes. The same replay runs through one engine with the radix cache and one without.

    python benchmarks/agentic_prefix.py                     # 16 sessions x 8 turns (the issue's shape)
    python benchmarks/agentic_prefix.py --sessions 4 --turns 4 --min-history 1024 --max-history 2048

Writes JSON to benchmarks/results/agentic_prefix.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build_sessions(args, vocab: int) -> list[list[list[int]]]:
    """Per session, the token chunks appended before each turn (turn 0: the whole starting history)."""
    gen = torch.Generator().manual_seed(args.seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    system = rand(args.system_tokens)
    sessions = []
    for _ in range(args.sessions):
        start = int(torch.randint(args.min_history, args.max_history + 1, (1,), generator=gen))
        turns = [system + rand(max(start - len(system), 1))]
        for _ in range(args.turns - 1):
            turns.append(rand(int(torch.randint(args.min_new, args.max_new + 1, (1,), generator=gen))))
        sessions.append(turns)
    return sessions


def replay(path: str, sessions, args, prefix_cache: bool) -> dict:
    from kestrel import LLM, SamplingParams

    longest = max(sum(len(c) for c in turns) + args.turns * args.output_tokens for turns in sessions)
    llm = LLM(
        path,
        max_total_tokens=len(sessions) * longest + 4096,
        max_running_requests=len(sessions),
        max_num_batched_tokens=args.batched_tokens,
        chunked_prefill_size=args.chunk,
        max_model_len=longest + 64,
        enable_prefix_caching=prefix_cache,
        state_track_interval=args.track_interval,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    history = [[] for _ in sessions]
    turn = [0] * len(sessions)
    live: dict[str, tuple[int, float]] = {}  # request id -> (session, submit time)
    first_token: dict[str, float] = {}
    ttfts, cached, prompt_tokens = [], 0, 0

    def submit(s: int) -> None:
        nonlocal prompt_tokens
        history[s] = history[s] + sessions[s][turn[s]]
        prompt_tokens += len(history[s])
        rid = engine.add_request(list(history[s]), params)
        live[rid] = (s, time.perf_counter())

    for s in range(len(sessions)):
        submit(s)
    start = time.perf_counter()
    while engine.has_unfinished:
        result = engine.step()
        now = time.perf_counter()
        for req in result.advanced:
            if req.request_id in live and req.request_id not in first_token:
                first_token[req.request_id] = now
        for out in result.finished:
            s, submitted = live.pop(out.request_id)
            ttfts.append(first_token.pop(out.request_id) - submitted)
            comp = out.outputs[0]
            cached += comp.cached_tokens
            history[s] = history[s] + comp.token_ids
            turn[s] += 1
            if turn[s] < args.turns:
                submit(s)
    elapsed = time.perf_counter() - start
    requests = len(sessions) * args.turns
    decode_tokens = requests * (args.output_tokens - 1)
    ttfts.sort()
    return {
        "prefix_cache": prefix_cache,
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": engine.scheduler.num_computed_tokens - decode_tokens,
        "cached_tokens": cached,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "wall_s": elapsed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: a random kimi_k3 'small')")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--min-history", type=int, default=2048)
    p.add_argument("--max-history", type=int, default=4096)
    p.add_argument("--min-new", type=int, default=100)
    p.add_argument("--max-new", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--batched-tokens", type=int, default=4096)
    p.add_argument("--track-interval", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/agentic_prefix.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from kestrel.models.checkpoint import make_model

            path = str(make_model("kimi_k3", "small", Path(tmp) / "k3", seed=0))
        from kestrel.config import load_model_config

        vocab = load_model_config(Path(path)).vocab_size
        sessions = build_sessions(args, vocab)
        results = [replay(path, sessions, args, True), replay(path, sessions, args, False)]
    on, off = results
    ratio = off["prefill_tokens_computed"] / max(on["prefill_tokens_computed"], 1)
    print(f"{args.sessions} sessions x {args.turns} turns, {on['prompt_tokens']} prompt tokens in all")
    print(f"{'':14}{'prefill computed':>18}{'cached':>10}{'TTFT mean':>11}{'TTFT P90':>10}{'wall':>8}")
    for r in results:
        name = "cache on" if r["prefix_cache"] else "cache off"
        print(
            f"{name:14}{r['prefill_tokens_computed']:>18,}{r['cached_tokens']:>10,}"
            f"{r['ttft_mean_s']:>10.3f}s{r['ttft_p90_s']:>9.3f}s{r['wall_s']:>7.1f}s"
        )
    print(f"prefill tokens: {ratio:.1f}x fewer with the prefix cache")
    mean, p90 = off["ttft_mean_s"] / on["ttft_mean_s"], off["ttft_p90_s"] / on["ttft_p90_s"]
    print(f"TTFT: mean {mean:.1f}x lower, P90 {p90:.1f}x lower")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results, "prefill_ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
