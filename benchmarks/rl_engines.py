"""A GRPO step's rollout (the mini recipe's) from two engines of one thread each vs from one, in one run.

`kestrel rl` runs its engines and its trainer in turn, so while one engine samples, the trainer's cores are idle; an
engine does not get faster with a second thread (its decode steps are dispatch-bound small ops). With `engines = 2`
the run starts two engines of one thread and deals the prompts to them in turn. This benchmark starts two engines as
the recipe does (its flags: deterministic inference, routing capture, fp32, LoRA), pushes the shipped adapter to
both, and sends the recipe's prompts (32 x 16 samples at its temperature, seeded as the trainer seeds them) to one
engine or to both, alternating within each repeat so machine noise hits both alike. Both must return the same
tokens and logprobs (batch-invariant engines). Reported: median wall time of each and their ratio.

    .venv/bin/python benchmarks/rl_engines.py
    .venv/bin/python benchmarks/rl_engines.py --prompts 8 --repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from report import write_result

from kestrel.config import load_model_config
from kestrel.tokenizer import load_tokenizer
from kestrel.train.recipes import RL_RECIPES
from kestrel.train.rl import engine_flags, rollout_seeds
from kestrel.train.rollout_client import EngineProcess, RolloutClient, adapter_checksum

RESULTS = Path(__file__).resolve().parent / "results" / "rl_engines.json"
ADAPTER = Path(__file__).resolve().parents[1] / "kestrel" / "assets" / "kestrel-mini-rl"


def rollout(client: RolloutClient, prompts: list[list[int]], cfg, seeds: list[int]) -> tuple[list, float]:
    """Per sample (tokens, logprobs); wall seconds."""
    t0 = time.perf_counter()
    groups = client.generate(
        prompts, cfg.samples_per_prompt, cfg.max_new_tokens, seeds, temperature=cfg.temperature, lora="policy"
    )
    seconds = time.perf_counter() - t0
    return [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for g in groups for r in g], seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=None, help="default: the recipe's prompts per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    recipe = RL_RECIPES["mini"]
    cfg = recipe.config
    n_prompts = args.prompts or cfg.prompts_per_step
    threads = cfg.engine_threads or cfg.threads
    print(f"engine torch threads: {threads} each; {n_prompts} prompts x {cfg.samples_per_prompt} samples")

    drawn = recipe.tasks.sample(random.Random(args.seed), n_prompts, load_tokenizer(recipe.model))
    prompts = [p.ids for p in drawn]
    seeds = rollout_seeds(dataclasses.replace(cfg, seed=args.seed), 0, list(range(n_prompts)))  # the run's step 1
    flags = engine_flags(cfg, load_model_config(recipe.model))
    times: dict[str, list[float]] = {"one engine": [], "two engines": []}
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        engines = [
            stack.enter_context(EngineProcess(recipe.model, flags, Path(logs) / f"e{i}.log", threads)) for i in (0, 1)
        ]
        clients = {
            "one engine": stack.enter_context(contextlib.closing(RolloutClient([engines[0].url]))),
            "two engines": stack.enter_context(contextlib.closing(RolloutClient([e.url for e in engines]))),
        }
        clients["two engines"].push_adapter("policy", ADAPTER, "0", adapter_checksum(ADAPTER))
        reference, _ = rollout(clients["two engines"], prompts, cfg, seeds)  # untimed: first touch of both engines
        for r in range(args.repeats):
            for name in times if r % 2 == 0 else reversed(times):
                samples, seconds = rollout(clients[name], prompts, cfg, seeds)
                assert samples == reference, f"{name}: samples differ from the reference rollout"
                times[name].append(seconds)
                print(f"repeat {r}: {name}: {seconds:.1f} s")
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = medians["one engine"] / medians["two engines"]
    tokens = sum(len(t) for t, _ in reference)
    print(f"sampled tokens: {tokens} (identical from one engine and from two)")
    for name, m in medians.items():
        print(f"{name}: median {m:.1f} s ({tokens / m:.0f} tok/s)")
    print(f"ratio (one / two): {ratio:.2f}x")
    write_result(
        RESULTS,
        "rl_engines",
        engine_threads=threads,
        prompts=n_prompts,
        samples=cfg.samples_per_prompt,
        sampled_tokens=tokens,
        seconds=times,
        median_s=medians,
        ratio=ratio,
    )


if __name__ == "__main__":
    main()
