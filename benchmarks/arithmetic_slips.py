"""Which step of the worked trace goes wrong when the GRPO base misses a held-out sub or mul question.

pct's misses were mostly one slip (the 15% trace stopping at 5%), and GRPO fixed it; this asks whether sub's and
mul's misses share a slip too. It answers `kestrel eval`'s held-out questions with new operands greedily (the
canonical phrasing, reasoning effort high) and checks each step of every missed trace (and, over `--draws` of the
mini recipe's training prompts, how often an operand pair calls for the step that slips):
- mul: a digit product (`7x8=56`) or a carry addition (`45+6=51`) that is wrong;
- sub: a digit compared as smaller when it is not (`2<2 so ...`: equal digits borrowed) or a smaller top digit
  subtracted without a borrow (`4-5=0`).

    .venv/bin/python benchmarks/arithmetic_slips.py            # 128 questions per operation (~20 s)
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import torch
from grpo_policy import MODEL, POLICY, policy_llm
from report import write_result

from kestrel import SamplingParams
from kestrel.train import evaluate
from kestrel.train.rl_tasks import arithmetic_prompt
from kestrel.train.synth.arithmetic import carry_crosses_ten, subtraction_columns

RESULTS = Path(__file__).resolve().parent / "results" / "arithmetic_slips.json"
PRODUCT = re.compile(r"(\d+)x(\d+)=(\d+)")
CARRY_ADD = re.compile(r"(\d+)\+(\d+)=(\d+)")
COMPARE = re.compile(r"(\d+)<(\d+) so")
NO_BORROW = re.compile(r"\b(\d)-(\d)=(\d+)")


def trace_of(text: str) -> str:
    """The worked steps: the reasoning up to its closing `So ... = ...` line."""
    return text.split("</think>")[0].split(" So ")[0]


def mul_slips(text: str) -> dict[str, bool]:
    steps = trace_of(text)
    return {
        "product": any(int(a) * int(b) != int(c) for a, b, c in PRODUCT.findall(steps)),
        "carry_add": any(int(a) + int(b) != int(c) for a, b, c in CARRY_ADD.findall(steps)),
    }


def sub_slips(text: str) -> dict[str, bool]:
    steps = trace_of(text)
    return {
        "false_compare": any(int(a) >= int(b) for a, b in COMPARE.findall(steps)),
        "no_borrow": any(int(a) < int(b) for a, b, _ in NO_BORROW.findall(steps)),
    }


def training_shares(draws: int, seed: int) -> dict[str, float]:
    """Over `draws` training prompts of each operation: the share whose operands call for each slipping step."""
    rng = random.Random(seed)
    muls = [arithmetic_prompt("mul", None, rng).meta for _ in range(draws)]
    subs = [
        subtraction_columns(m["a"], m["b"]) for m in (arithmetic_prompt("sub", None, rng).meta for _ in range(draws))
    ]
    return {
        "mul_carry_crosses_ten": sum(carry_crosses_ten(m["a"], m["b"]) for m in muls) / draws,
        "sub_equal_column": sum(s["equal_column"] for s in subs) / draws,
        "sub_borrow_column": sum(s["borrow_column"] for s in subs) / draws,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=128, help="held-out questions per operation")
    ap.add_argument("--seed", type=int, default=evaluate.HELD_OUT_SEED, help="draws the held-out questions")
    ap.add_argument("--lora", default=None, help="answer with this PEFT adapter folder instead of the base")
    ap.add_argument("--draws", type=int, default=5000, help="training prompts per operation for the shares")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    llm = policy_llm(args.lora)
    checks = {"sub": sub_slips, "mul": mul_slips}
    cases = [(key, ep) for key, ep in evaluate.arithmetic_cases(args.n, args.seed) if key in checks]
    params = SamplingParams(temperature=0, max_tokens=256)
    outs = llm.generate(
        [evaluate.prompt_text(ep) for _, ep in cases], params, use_tqdm=False, lora_name=POLICY if args.lora else None
    )
    found = {
        key: {"questions": 0, "misses": 0, "any_slip": 0} | dict.fromkeys(check(""), 0) for key, check in checks.items()
    }
    for (key, ep), out in zip(cases, outs):
        text = out.outputs[0].text
        found[key]["questions"] += 1
        if evaluate.arithmetic_correct(ep, text):
            continue
        row = checks[key](text)
        found[key]["misses"] += 1
        found[key]["any_slip"] += any(row.values())
        for slip, hit in row.items():
            found[key][slip] += hit
    for key, row in found.items():
        print(f"{key}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    shares = training_shares(args.draws, 0)
    print("training prompts whose operands call for the step: " + ", ".join(f"{k} {v:.3f}" for k, v in shares.items()))
    write_result(
        RESULTS,
        "arithmetic_slips",
        model=MODEL,
        adapter_path=args.lora,
        n=args.n,
        seed=args.seed,
        misses=found,
        training_shares=shares,
    )


if __name__ == "__main__":
    main()
