"""Which held-out arithmetic phrasings the GRPO base misreads, and as which operation.

In nine gradings (rl10-rl18) sub in held-out phrasings never rose beyond noise, at 0.18-0.20. This answers each
held-out phrasing of each operation with new operands greedily (reasoning effort high, no typos) and reads the
operation the worked trace carried out off its last closing line (`So 71 + 70 = 141.`): a phrasing whose questions are
traced as another operation is a misread question, not an arithmetic slip, and no operand drill reaches it. It also
says, per phrasing, whether its words outside the slots all occur in some training phrasing (SFT or RL's own).

    .venv/bin/python benchmarks/held_out_phrasings.py          # 24 questions per phrasing (~1 min)
    .venv/bin/python benchmarks/held_out_phrasings.py --recipe mini-wide   # the base trained on the wider phrasings
"""

from __future__ import annotations

import argparse
import random
import re
from collections import Counter
from pathlib import Path

import torch
from grpo_policy import POLICY, policy_llm
from report import write_result

from kestrel import SamplingParams
from kestrel.train import evaluate
from kestrel.train.recipes import RL_RECIPES
from kestrel.train.rl_tasks import ARITHMETIC_PHRASINGS, WIDE_ARITHMETIC_PHRASINGS
from kestrel.train.synth.arithmetic import HELD_OUT_TEMPLATES, arithmetic_episode
from kestrel.train.synth.episode import HELD_OUT

RESULTS = Path(__file__).resolve().parent / "results" / "held_out_phrasings.json"
CLOSING = re.compile(r"So (?:(\d+)% of \d+|\d+ ([-+x]) \d+|half of \d+) ")
TRACED_AS = {"+": "add", "-": "sub", "x": "mul"}
WORD = re.compile(r"[a-z]+")
# Each RL recipe's base and the phrasings it was trained on (its SFT ones) or asked in (RL's own).
PHRASINGS = {"mini": ARITHMETIC_PHRASINGS, "mini-wide": WIDE_ARITHMETIC_PHRASINGS}


def traced_operation(text: str) -> str:
    """The operation of the trace's last closing line (add, sub, mul, pct; a pct trace closes its inner steps
    first), or `none`."""
    closings = list(CLOSING.finditer(text.split("</think>")[0]))
    if not closings:
        return "none"
    m = closings[-1]
    return "pct" if m.group(1) or m.group(0).startswith("So half") else TRACED_AS[m.group(2)]


def words_of(phrasings: dict[str, list[str]]) -> set[str]:
    """Every word the phrasings (of any operation) use."""
    return {w for ts in phrasings.values() for t in ts for w in WORD.findall(t.lower())}


def unseen_words(template: str, seen: set[str]) -> list[str]:
    """Words of a held-out phrasing outside `seen` (the training phrasings' words)."""
    return sorted({w for w in WORD.findall(template.lower()) if w not in {"a", "b"}} - seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=24, help="questions per held-out phrasing")
    ap.add_argument("--seed", type=int, default=5, help="draws the operands")
    ap.add_argument("--lora", default=None, help="answer with this PEFT adapter folder instead of the base")
    ap.add_argument("--recipe", default="mini", choices=list(PHRASINGS), help="RL recipe: its base and phrasings")
    ap.add_argument("--model", default=None, help="the base that answers (default: the recipe's)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    model = args.model or RL_RECIPES[args.recipe].model
    llm = policy_llm(args.lora, model)
    rng = random.Random(args.seed)
    cases = [
        (op, t, arithmetic_episode(rng, HELD_OUT, op, None, [t], "high", 0.0))
        for op, templates in HELD_OUT_TEMPLATES.items()
        for t in templates
        for _ in range(args.n)
    ]
    params = SamplingParams(temperature=0, max_tokens=160)
    lora_name = POLICY if args.lora else None
    outs = llm.generate([evaluate.prompt_text(ep) for *_, ep in cases], params, use_tqdm=False, lora_name=lora_name)
    seen = words_of(PHRASINGS[args.recipe])
    rows: dict[str, dict] = {}
    for (op, template, ep), out in zip(cases, outs):
        text = out.outputs[0].text
        new_row = {"op": op, "right": 0, "traced_as": Counter(), "unseen": unseen_words(template, seen)}
        row = rows.setdefault(template, new_row)
        row["right"] += evaluate.arithmetic_correct(ep, text)
        row["traced_as"][traced_operation(text)] += 1
    for template, row in rows.items():
        traced = ", ".join(f"{k} {v}" for k, v in row["traced_as"].most_common())
        unseen = f"  unseen words: {' '.join(row['unseen'])}" if row["unseen"] else ""
        print(f"{row['op']:>3} {row['right']:>3}/{args.n} right, traced as {traced:<24} {template!r}{unseen}")
    write_result(
        RESULTS,
        "held_out_phrasings",
        model=model,
        recipe=args.recipe,
        adapter_path=args.lora,
        n=args.n,
        seed=args.seed,
        phrasings={t: {**r, "traced_as": dict(r["traced_as"])} for t, r in rows.items()},
    )


if __name__ == "__main__":
    main()
