"""Offline throughput: Kestrel's engine vs Hugging Face `generate`, same checkpoint and prompts, one run.

Prints output tokens/s of each at the given concurrency and their ratio, plus batch-1 inter-token latency (eager and
with `--compile`).
Writes JSON to benchmarks/results/offline_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]


def kestrel_throughput(path: str, prompts, new_tokens: int) -> tuple[float, float]:
    from kestrel import LLM, SamplingParams

    llm = LLM(
        path,
        max_total_tokens=sum(len(p) + new_tokens for p in prompts) + 1024,
        max_running_requests=len(prompts),
        max_num_batched_tokens=4096,
        chunked_prefill_size=1024,
    )
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return produced / elapsed, elapsed


def kestrel_itl_runner(path: str, prompt, new_tokens: int, compile: bool = False):
    """A function that generates `new_tokens` at batch 1 and returns the decode steps' durations (prefill excluded)."""
    from kestrel import LLM, SamplingParams

    engine = LLM(path, max_total_tokens=len(prompt) + new_tokens + 64, compile=compile, compile_max_bs=1).engine

    def run() -> list[float]:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
        times = []
        engine.step()  # prefill
        while engine.has_unfinished:
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return times

    run()  # warm-up
    return run


def hf_generate(model, prompts, new_tokens: int, batch_size: int) -> float:
    """Seconds to generate `new_tokens` for every prompt in left-padded batches."""
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, p in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    return time.perf_counter() - start


def hf_step_itl_runner(model, prompt, new_tokens: int):
    """A function that runs batch-1 `generate` and returns the gaps between consecutive tokens.

    A stopping criterion is called once per generated token, after that step's forward, logits processing and
    sampling, so the gaps between its calls are the inter-token latencies a `generate` user sees.
    """
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def run() -> list[float]:
        clock = StepClock()
        with torch.no_grad():
            model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new_tokens + 1,
                min_new_tokens=new_tokens + 1,
                do_sample=False,
                pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        return [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]

    run()  # warm-up
    return run


def interleaved_itl(runners: dict, rounds: int) -> dict[str, list[float]]:
    """Median step time of each runner in each round, the runners taking turns (a shared machine's load drifts)."""
    medians: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            medians[name].append(statistics.median(run()))
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="8,32")
    ap.add_argument("--itl-tokens", type=int, default=32)
    ap.add_argument("--itl-repeats", type=int, default=5, help="ITL rounds, engines taking turns (median of rounds)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled (--compile) batch-1 ITL")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: make-model kimi_linear small)")
    ap.add_argument("--out", default="benchmarks/results/offline_throughput.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # the engine does this on CPU; give transformers the same footing
    print(f"torch threads: {torch.get_num_threads()}")

    from transformers import AutoModelForCausalLM

    from kestrel.models.checkpoint import make_model

    path = args.model or str(make_model("kimi_linear", "small", Path(tempfile.mkdtemp()) / "kl-small", seed=0))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab, seed=0)
    print(f"model {path}: {len(prompts)} prompts of {args.min_len}-{args.max_len} tokens, {args.new_tokens} new each")

    k_tps, k_time = kestrel_throughput(path, prompts, args.new_tokens)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_results = {}
    for bs in [int(b) for b in args.hf_batch_sizes.split(",")]:
        seconds = hf_generate(hf, prompts, args.new_tokens, bs)
        hf_results[bs] = len(prompts) * args.new_tokens / seconds
        print(f"  transformers batch {bs}: {hf_results[bs]:.1f} tok/s")
    best_bs = max(hf_results, key=hf_results.get)

    runners = {
        "kestrel": kestrel_itl_runner(path, prompts[0], args.itl_tokens),
        "transformers": hf_step_itl_runner(hf, prompts[0], args.itl_tokens),
    }
    if not args.no_compile:
        runners["kestrel_compiled"] = kestrel_itl_runner(path, prompts[0], args.itl_tokens, compile=True)
    rounds = interleaved_itl(runners, args.itl_repeats)
    k_itl, hf_itl = statistics.median(rounds["kestrel"]), statistics.median(rounds["transformers"])
    k_itl_compiled = statistics.median(rounds["kestrel_compiled"]) if not args.no_compile else None
    speedups = [h / k for h, k in zip(rounds["transformers"], rounds["kestrel"])]
    print(f"  batch-1 ITL speedup per round: {', '.join(f'{x:.2f}' for x in speedups)}")
    result = {
        "threads": torch.get_num_threads(),
        "num_prompts": len(prompts),
        "prompt_lens": [args.min_len, args.max_len],
        "new_tokens": args.new_tokens,
        "kestrel_tok_s": k_tps,
        "transformers_tok_s": hf_results[best_bs],
        "transformers_best_batch": best_bs,
        "throughput_ratio": k_tps / hf_results[best_bs],
        "kestrel_itl_ms": k_itl * 1e3,
        "transformers_itl_ms": hf_itl * 1e3,
        "itl_speedup": hf_itl / k_itl,
        "itl_speedup_per_round": speedups,
        "itl_rounds": args.itl_repeats,
    }
    if k_itl_compiled is not None:
        result |= {"kestrel_compiled_itl_ms": k_itl_compiled * 1e3, "compiled_itl_speedup": hf_itl / k_itl_compiled}
    print(f"{'':24}{'kestrel':>12}{'transformers':>14}{'ratio':>8}")
    print(f"{'output tok/s':24}{k_tps:12.1f}{hf_results[best_bs]:14.1f}{result['throughput_ratio']:8.2f}")
    print(f"{'batch-1 ITL (ms)':24}{k_itl * 1e3:12.1f}{hf_itl * 1e3:14.1f}{result['itl_speedup']:8.2f}")
    if k_itl_compiled is not None:
        speedup = result["compiled_itl_speedup"]
        print(f"{'  with --compile':24}{k_itl_compiled * 1e3:12.1f}{hf_itl * 1e3:14.1f}{speedup:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
