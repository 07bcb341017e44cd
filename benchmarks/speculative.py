"""DFlash speculative decoding on the embedded model: acceptance length and output tok/s with vs without it.

Held-out synthetic chat prompts (the distribution the shipped draft was distilled on, other seeds), greedy, answered
by engines with and without `--speculative-algorithm dflash` at concurrency 1 / 4 / 16 (max_running_requests =
concurrency, `concurrency × --rounds` prompts each, at least `--min-prompts`). Configurations alternate inside every
repeat so machine noise hits them alike; tok/s is output tokens / wall time, the ratio is median(spec) /
median(plain). Acceptance length is tokens committed per verify block (accepted drafts + the target's own token),
over all blocks of the run, at block sizes 5 and 7. In float32 (the default) the outputs must be identical token for
token (checked); in bfloat16, the shipped model's dtype, a verify block's multi-row GEMMs round differently from a
decode step's one-row GEMVs, so near-ties may resolve differently: the count of identical outputs is reported.

    .venv/bin/python benchmarks/speculative.py --threads 1 --repeats 3
    .venv/bin/python benchmarks/speculative.py --model kestrel/assets/kestrel-mini-tied \
        --draft kestrel/assets/kestrel-mini-tied/dflash      # another target with its own draft
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from report import write_result

from kestrel.engine.llm import LLM
from kestrel.engine.sampling_params import SamplingParams
from kestrel.train.dflash import chat_prompts

RESULTS = Path(__file__).resolve().parent / "results" / "speculative.json"
HELD_OUT_SEED = 20_000


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, int, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    return seconds, sum(len(t) for t in tokens), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target checkpoint (default: the embedded kestrel-mini)")
    ap.add_argument("--draft", default=None, help="its DFlash draft (default: the shipped one, for the embedded model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=2, help="prompts per concurrency slot")
    ap.add_argument("--min-prompts", type=int, default=8, help="at least this many prompts per level (c=1: not 2)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blocks", default="5,7", help="block sizes whose acceptance length is measured")
    ap.add_argument("--speed-block", type=int, default=7, help="block size of the tok/s comparison")
    ap.add_argument("--replayssm", action="store_true", help="ReplaySSM rollback instead of snapshots")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    print(
        f"model {args.model or 'kestrel-mini'}, threads {args.threads}, {args.dtype}, concurrency {levels}, "
        f"max_tokens {args.max_tokens}, repeats {args.repeats}"
    )

    exact = args.dtype == "float32"
    common = dict(dtype=args.dtype, max_total_tokens=65536, max_model_len=4096, num_threads=args.threads)
    spec = dict(speculative_algorithm="dflash", enable_linear_replayssm_spec=args.replayssm)
    spec |= dict(speculative_draft_model=args.draft) if args.draft else {}

    # Acceptance length per block size (greedy: it does not depend on the batch), outputs checked against plain.
    prompts = chat_prompts(HELD_OUT_SEED, 32)
    plain_llm = LLM(args.model, max_running_requests=32, **common)
    _, _, want = run(plain_llm, prompts, args.max_tokens)
    acceptance, identical = {}, {}
    for b in blocks:
        llm = LLM(args.model, max_running_requests=32, speculative_num_draft_tokens=b, **spec, **common)
        _, _, got = run(llm, prompts, args.max_tokens)
        same = sum(g == w for g, w in zip(got, want))
        assert same == len(want) or not exact, f"block {b}: speculative output differs from plain greedy"
        identical[b] = same
        acceptance[b] = llm.engine.spec.stats()["spec_accept_length"]
        print(
            f"block {b}: acceptance length {acceptance[b]:.3f} over {llm.engine.spec.num_verify_steps} blocks; "
            f"{same}/{len(want)} outputs identical to plain greedy"
        )

    rows = []
    for c in levels:
        batch = chat_prompts(HELD_OUT_SEED + c, max(c * args.rounds, args.min_prompts))
        engines = {
            "plain": LLM(args.model, max_running_requests=c, **common),
            "dflash": LLM(
                args.model, max_running_requests=c, speculative_num_draft_tokens=args.speed_block, **spec, **common
            ),
        }
        tps: dict[str, list[float]] = {k: [] for k in engines}
        outputs = {}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                seconds, tokens, outputs[name] = run(llm, batch, args.max_tokens)
                tps[name].append(tokens / seconds)
        assert outputs["plain"] == outputs["dflash"] or not exact, f"concurrency {c}: outputs differ"
        plain, fast = statistics.median(tps["plain"]), statistics.median(tps["dflash"])
        accept = engines["dflash"].engine.spec.stats()["spec_accept_length"]
        rows.append(
            {
                "concurrency": c,
                "plain_tok_s": round(plain, 1),
                "dflash_tok_s": round(fast, 1),
                "speedup": round(fast / plain, 2),
                "accept_length": round(accept, 3),
            }
        )

    print(f"\n{'conc':>5} {'plain tok/s':>12} {'dflash tok/s':>13} {'speedup':>8} {'accept':>7}")
    for r in rows:
        print(
            f"{r['concurrency']:>5} {r['plain_tok_s']:>12.1f} {r['dflash_tok_s']:>13.1f} {r['speedup']:>7.2f}x "
            f"{r['accept_length']:>7.3f}"
        )
    print("acceptance length: " + ", ".join(f"block {b}: {a:.3f}" for b, a in acceptance.items()))
    write_result(
        args.out,
        "speculative",
        model=args.model or "kestrel-mini",
        acceptance_length={str(b): round(a, 3) for b, a in acceptance.items()},
        identical_outputs={str(b): f"{n}/{len(prompts)}" for b, n in identical.items()},
        dtype=args.dtype,
        speed_block=args.speed_block,
        replayssm=args.replayssm,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        rows=rows,
    )


if __name__ == "__main__":
    main()
