"""Where GRPO's gradient comes from in the mini recipe, per task, and which held-out misses a sample can reach.

A group of samples teaches GRPO only when they disagree: all right or all wrong, every advantage is 0 and the group
is filtered out. So a task lifts only through its mixed groups, and a held-out question the policy misses moves only
if some sample of it can be right. For each of the recipe's tasks (and the slip tasks,
`kestrel.train.rl_tasks.SLIP_TASKS`, where the recipe lacks them) this draws `--prompts` training prompts (its own
prompts, as a step draws them) and samples `--samples` of each at the recipe's temperature and token budget: the
share of groups all right, mixed and all wrong. For each held-out arithmetic cell (`kestrel eval`'s questions, on
`--seed`) it answers greedily, as the evaluation does, then samples the same way: of the greedy misses, the share
with at least one right sample (reachable), and of the greedy hits, the share with at least one wrong sample
(fragile). The policy is the base, or base and an adapter in one run with `--lora`.

    .venv/bin/python benchmarks/grpo_signal.py                     # the base (README: GRPO, ~20 min on 2 threads)
    .venv/bin/python benchmarks/grpo_signal.py --lora kestrel/assets/kestrel-mini-rl --prompts 8 --held-out 8
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path

import torch
from grpo_policy import POLICY, policy_llm
from report import write_result

from kestrel import LLM, SamplingParams
from kestrel.train import evaluate
from kestrel.train.recipes import RL_RECIPES
from kestrel.train.rl_tasks import SLIP_TASKS
from kestrel.train.synth.episode import Episode

RESULTS = Path(__file__).resolve().parent / "results" / "grpo_signal.json"
HELD_OUT_TOKENS = 256  # `kestrel eval`'s arithmetic budget
RECIPE = RL_RECIPES["mini"]
Check = Callable[[Episode, str, list[int]], bool]  # (episode, completion text, its token ids) -> right?


def sample_right(
    llm: LLM, episodes: list[Episode], check: Check, params: SamplingParams, lora: str | None
) -> list[list[bool]]:
    """Per episode, per sample: right?"""
    outs = llm.generate([evaluate.prompt_text(ep) for ep in episodes], params, use_tqdm=False, lora_name=lora)
    return [[check(ep, c.text, c.token_ids) for c in o.outputs] for ep, o in zip(episodes, outs)]


def group_shares(groups: list[list[bool]]) -> dict[str, float]:
    """Mean reward and the share of groups all right, mixed (a gradient) and all wrong."""
    n = len(groups)
    return {
        "reward": sum(sum(g) / len(g) for g in groups) / n,
        "all_right": sum(all(g) for g in groups) / n,
        "mixed": sum(any(g) and not all(g) for g in groups) / n,
        "all_wrong": sum(not any(g) for g in groups) / n,
    }


def reach(greedy: list[bool], groups: list[list[bool]]) -> dict[str, float | int]:
    """Greedy accuracy; of its misses, the share some sample gets right; of its hits, the share some sample misses."""
    misses = [g for ok, g in zip(greedy, groups) if not ok]
    hits = [g for ok, g in zip(greedy, groups) if ok]
    return {
        "greedy": sum(greedy) / len(greedy),
        "misses": len(misses),
        "reachable": sum(any(g) for g in misses) / max(len(misses), 1),
        "fragile": sum(not all(g) for g in hits) / max(len(hits), 1),
    }


def held_out_right(ep: Episode, text: str, ids: list[int]) -> bool:
    return evaluate.arithmetic_correct(ep, text)


def measure(llm: LLM, lora: str | None, args: argparse.Namespace) -> dict[str, dict]:
    """One policy (`lora`: an adapter's name, or None for the base): the task rows, then the held-out cells."""
    cfg = RECIPE.config
    sampled = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, n=args.samples, seed=args.seed)
    tasks = {}
    recipe_names = {t.name for t in RECIPE.tasks.tasks}
    for task in RECIPE.tasks.tasks + tuple(t for t in SLIP_TASKS if t.name not in recipe_names):
        rng = random.Random(args.seed)
        episodes = [task.make(rng) for _ in range(args.prompts)]
        groups = sample_right(llm, episodes, lambda ep, text, ids, t=task: t.reward(ep, text, ids) > 0, sampled, lora)
        tasks[task.name] = group_shares(groups)
        print(f"  task {task.name:6s} {_fmt(tasks[task.name])}")
    cells = {}
    greedy_params = SamplingParams(temperature=0, max_tokens=HELD_OUT_TOKENS)
    held_sampled = SamplingParams(
        temperature=cfg.temperature, max_tokens=HELD_OUT_TOKENS, n=args.samples, seed=args.seed
    )
    cases = evaluate.arithmetic_cases(args.held_out, args.eval_seed)
    for key in dict.fromkeys(k for k, _ in cases):
        episodes = [ep for k, ep in cases if k == key]
        greedy = [g[0] for g in sample_right(llm, episodes, held_out_right, greedy_params, lora)]
        groups = sample_right(llm, episodes, held_out_right, held_sampled, lora)
        cells[key] = reach(greedy, groups)
        print(f"  held-out {key:18s} {_fmt(cells[key])}")
    return {"tasks": tasks, "held_out": cells}


def _fmt(row: dict[str, float | int]) -> str:
    return "  ".join(f"{k} {v}" if isinstance(v, int) else f"{k} {v:.3f}" for k, v in row.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lora", default=None, help="also measure with this PEFT adapter folder")
    ap.add_argument("--prompts", type=int, default=32, help="training prompts per task")
    ap.add_argument("--held-out", type=int, default=128, help="held-out questions per arithmetic cell")
    ap.add_argument("--samples", type=int, default=None, help="samples per prompt (default: the recipe's group)")
    ap.add_argument("--seed", type=int, default=0, help="draws the training prompts and seeds the sampling")
    ap.add_argument("--eval-seed", type=int, default=evaluate.HELD_OUT_SEED, help="draws the held-out questions")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.samples = args.samples or RECIPE.config.samples_per_prompt
    print(f"torch threads: {torch.get_num_threads()}; {args.samples} samples at T {RECIPE.config.temperature}")
    llm = policy_llm(args.lora)
    policies = {"base": None} | ({"adapter": POLICY} if args.lora else {})
    found = {}
    for name, lora in policies.items():
        print(name)
        found[name] = measure(llm, lora, args)
    write_result(
        RESULTS,
        "grpo_signal",
        model=RECIPE.model,
        adapter_path=args.lora,
        prompts_per_task=args.prompts,
        held_out_per_cell=args.held_out,
        samples=args.samples,
        temperature=RECIPE.config.temperature,
        seed=args.seed,
        eval_seed=args.eval_seed,
        policies=found,
    )


if __name__ == "__main__":
    main()
