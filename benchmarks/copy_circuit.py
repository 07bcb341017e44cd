"""Does the copy (induction) circuit form, and how soon? Random-token copying through Kestrel's own training stack.

Each sequence is `[bos, filler…, marker, span…, sep, span…]` with fresh random tokens (variable filler and span
length, so only content-based copying helps); the loss covers the second span. Arms differ in vocabulary size and in
whether the LM head is tied to the embedding, all in the same run, same seeds, same model shape (kimi_k3: KDA + DSA,
MoE, AttnRes). Prints held-out next-token accuracy on the copied span every `--eval-every` steps.

    .venv/bin/python benchmarks/copy_circuit.py --steps 300 --arms 128:untied 2048:untied 2048:tied
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from kestrel.config import model_config_from_dict
from kestrel.models.checkpoint import init_random_
from kestrel.models.loader import build_model
from kestrel.train.recipes import k3_mini_config
from kestrel.train.sft import lm_loss, packed_batch

MARKER, SEP, FIRST_FREE = 4, 3, 8


def copy_example(rng: random.Random, vocab: int) -> tuple[list[int], list[bool]]:
    span = [rng.randrange(FIRST_FREE, vocab) for _ in range(rng.randint(2, 8))]
    filler = [rng.randrange(FIRST_FREE, vocab) for _ in range(rng.randint(0, 12))]
    ids = [1, *filler, MARKER, *span, SEP, *span]
    return ids, [False] * (len(ids) - len(span)) + [True] * len(span)


def run_arm(vocab: int, tied: bool, args: argparse.Namespace) -> list[tuple[int, float]]:
    config = k3_mini_config(vocab, args.hidden, args.layers, args.experts, tie_embeddings=tied)
    torch.manual_seed(0)
    model = init_random_(build_model(model_config_from_dict(config), torch.float32), 0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng, eval_rng = random.Random(0), random.Random(99)
    held_out = [copy_example(eval_rng, vocab) for _ in range(64)]
    curve, start = [], time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        batch, targets = packed_batch([copy_example(rng, vocab) for _ in range(args.batch_size)], model.device)
        loss = lm_loss(model, batch, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                batch, targets = packed_batch(held_out, model.device)
                rows = targets != -100
                predicted = model.logits(model(batch)[rows]).argmax(-1)
                accuracy = (predicted == targets[rows]).float().mean().item()
            model.train()
            curve.append((step, accuracy))
            label = f"vocab {vocab} {'tied' if tied else 'untied'}"
            print(
                f"{label:>18}  step {step:4d}  loss {loss.item():.3f}  copy acc {accuracy:.3f}  "
                f"{time.perf_counter() - start:.0f}s",
                flush=True,
            )
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=["128:untied", "2048:untied", "2048:tied"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}; hidden {args.hidden}, {args.layers} layers")
    results = {}
    for arm in args.arms:
        vocab, kind = arm.split(":")
        results[arm] = run_arm(int(vocab), kind == "tied", args)
    print("\nfirst step with held-out copy accuracy >= 0.9:")
    for arm, curve in results.items():
        print(f"  {arm:>12}: {next((s for s, a in curve if a >= 0.9), 'not reached')}")


if __name__ == "__main__":
    main()
