"""A GRPO rollout (the mini recipe's shape) with the samples of each prompt sharing its prefill vs each sample
prefilling the prompt itself, in one run.

The mini recipe asks `--prompts` prompts drawn from its task mix (arithmetic and tool requests with their tool
schemas) for `--samples` samples each, at its temperature, with deterministic inference, routed-expert capture and
the shipped adapter, on one torch thread, as its rollout engine runs them. With sharing, one sample of a prompt
prefills it and the others start from its checkpoint a step later (`kestrel.engine.shared_prefill`); the baseline
turns that off on the same engine's cache. After one untimed rollout, both modes alternate within each repeat (so
machine noise hits them alike) and must sample the same tokens and logprobs. Reported: prompt tokens computed,
median wall time, ratio = median(baseline) / median(shared).

    .venv/bin/python benchmarks/grpo_rollout.py                  # 32 prompts x 16 samples on 1 thread, as the recipe
    .venv/bin/python benchmarks/grpo_rollout.py --threads 2 --lora '' --prompts 8 --repeats 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from report import write_result

from kestrel import LLM, SamplingParams
from kestrel.tokenizer import load_tokenizer
from kestrel.train.rl_tasks import MINI_TASKS

RESULTS = Path(__file__).resolve().parent / "results" / "grpo_rollout.json"
MODEL = Path(__file__).resolve().parents[1] / "kestrel" / "assets" / "kestrel-mini-tied"
ADAPTER = MODEL.parent / "kestrel-mini-rl"
MODES = ("shared", "baseline")


def rollout(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, shared: bool, lora: str | None
) -> tuple[list, int, float]:
    """(per sample: tokens and logprobs), prompt tokens computed, wall seconds."""
    llm.engine.cache.shares_prefixes = shared  # the instance attribute shadows the cache class's
    llm.engine.cache.clear()
    sched = llm.engine.scheduler
    before = sched.num_computed_tokens
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_name=lora, return_routed_experts=True)
    seconds = time.perf_counter() - t0
    samples = [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]
    decoded = sum(max(len(t) - 1, 0) for t, _ in samples)  # every sampled token but the first is a decode row
    return samples, sched.num_computed_tokens - before - decoded, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--threads", type=int, default=1, help="the recipe's rollout engine runs on 1")
    ap.add_argument("--lora", default=str(ADAPTER), help="rollouts run on this adapter, as the recipe's ('' : none)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")

    llm = LLM(
        args.model,
        dtype="float32",
        deterministic_inference=True,
        max_running_requests=args.prompts * args.samples,
        enable_return_routed_experts=True,
        enable_lora=bool(args.lora),
        lora_paths=[f"policy={args.lora}"] if args.lora else None,
    )
    lora = "policy" if args.lora else None
    drawn = MINI_TASKS.sample(random.Random(args.seed), args.prompts, load_tokenizer(args.model))
    prompts = [p.ids for p in drawn]
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_new_tokens, n=args.samples, seed=args.seed, logprobs=0
    )
    times: dict[str, list[float]] = {m: [] for m in MODES}
    computed: dict[str, int] = {}
    reference, _, _ = rollout(llm, prompts, params, True, lora)  # untimed: first-touch of pages and allocators
    for _ in range(args.repeats):
        for mode in MODES:
            samples, prefill, seconds = rollout(llm, prompts, params, mode == "shared", lora)
            if samples != reference:
                raise SystemExit(f"{mode}: the samples differ from the other mode's (they must be bit-identical)")
            times[mode].append(seconds)
            computed[mode] = prefill
            print(f"{mode:9s} {seconds:7.2f} s   prompt tokens computed {prefill}")
    generated = sum(len(t) for t, _ in reference)
    medians = {m: statistics.median(v) for m, v in times.items()}
    ratio = medians["baseline"] / medians["shared"]
    prompt_tokens = sum(len(p) for p in prompts)
    print(
        f"\n{args.prompts} prompts x {args.samples} samples ({prompt_tokens} prompt tokens, {generated} generated)"
        f"\nprompt tokens computed: shared {computed['shared']}, baseline {computed['baseline']}"
        f"\nmedian seconds: shared {medians['shared']:.2f}, baseline {medians['baseline']:.2f}"
        f"  -> {ratio:.2f}x faster (same tokens and logprobs)"
    )
    write_result(
        RESULTS,
        "grpo_rollout",
        model=args.model,
        prompts=args.prompts,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated,
        prompt_tokens_computed=computed,
        seconds=times,
        median_seconds=medians,
        speedup=ratio,
    )


if __name__ == "__main__":
    main()
