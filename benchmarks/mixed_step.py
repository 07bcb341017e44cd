"""Mixed step: one engine step holding 32 decode rows plus a whole new prompt's prefill, against the two run apart.

A prompt that joins a decoding batch should cost about what its prefill costs alone: the decode rows ride along
in the same forward. For each prompt length P, one process times (a) a pure decode step of the 32 decoders,
(b) the mixed step right after a fresh P-token prompt joins them (asserted to hold exactly 32 one-token decode
rows and the prompt's whole prefill), and (c) the same prefill on a second, idle engine with the same checkpoint
and options. (a), (b) and (c) alternate within each repeat so machine noise hits all three alike.
Ratio = median(b) / (median(a) + median(c)); the target is <= 1.3.

    .venv/bin/python benchmarks/mixed_step.py --threads 2 --prompt-lens 4,64,512 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from report import write_result

from kestrel import LLM, SamplingParams
from kestrel.engine.engine import Engine
from kestrel.models.checkpoint import make_model

RESULTS = Path(__file__).resolve().parent / "results" / "mixed_step.json"
MAX_MODEL_LEN = 4096
DECODER_PROMPT = 64
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN, ignore_eos=True)  # engine caps at max_model_len


def timed_step(engine: Engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def decode_step(engine: Engine, decoding: int) -> float:
    """One step of the decoders alone; each must advance by exactly one token."""
    before = {id(r): r.computed_len for r in engine.scheduler.running}
    seconds = timed_step(engine)
    running = engine.scheduler.running
    assert len(running) == decoding and all(r.computed_len == before[id(r)] + 1 for r in running), "not a decode step"
    return seconds


def mixed_step(engine: Engine, prompt: list[int], decoding: int) -> float:
    """The step in which `prompt` joins the decoders: 32 decode rows + its whole prefill, then it is aborted."""
    before = {id(r): r.computed_len for r in engine.scheduler.running}
    rid = engine.add_request(prompt, GREEDY)
    seconds = timed_step(engine)
    (new,) = engine.requests(rid)
    old = [r for r in engine.scheduler.running if r is not new]
    assert len(old) == decoding and all(r.computed_len == before[id(r)] + 1 for r in old), "decoders did not advance"
    assert new.computed_len == len(prompt) and len(new.output_ids) == 1, "prefill was not whole in the mixed step"
    engine.abort(rid)
    return seconds


def alone_prefill(engine: Engine, prompt: list[int]) -> float:
    """The same prefill on an idle engine."""
    rid = engine.add_request(prompt, GREEDY)
    seconds = timed_step(engine)
    (req,) = engine.requests(rid)
    assert req.computed_len == len(prompt) and len(engine.scheduler.running) == 1, "prefill was not whole"
    engine.abort(rid)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: random kimi_k3 small)")
    ap.add_argument("--decoding", type=int, default=32, help="requests decoding throughout")
    ap.add_argument("--prompt-lens", default="4,64,512", help="comma-separated lengths of the joining prompt")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds per prompt length")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="pass compile=True to the engine")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = ap.parse_args()
    prompt_lens = [int(p) for p in args.prompt_lens.split(",")]

    torch.set_num_threads(args.threads)
    path = args.model or make_model("kimi_k3", "small", Path(tempfile.mkdtemp()) / "k3-small", seed=args.seed)
    raw = json.loads((path / "config.json").read_text())
    text_cfg = raw.get("text_config", raw)
    vocab = text_cfg["vocab_size"]
    options: dict[str, Any] = dict(
        max_model_len=MAX_MODEL_LEN,
        max_total_tokens=(args.decoding + 2) * MAX_MODEL_LEN,
        max_running_requests=args.decoding + 1,
        chunked_prefill_size=1024,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    if args.compile:
        options["compile"] = True
    mixed_engine, idle_engine = LLM(str(path), **options).engine, LLM(str(path), **options).engine
    gen = torch.Generator().manual_seed(args.seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    for _ in range(args.decoding):
        mixed_engine.add_request(prompt(DECODER_PROMPT), GREEDY)
    while mixed_engine.scheduler.waiting or not all(r.output_ids for r in mixed_engine.scheduler.running):
        mixed_engine.step()
    for _ in range(3):
        decode_step(mixed_engine, args.decoding)

    print(
        f"torch {torch.__version__} | threads {torch.get_num_threads()} | {platform.machine()} | "
        f"{raw.get('model_type', '?')} ({path}) | {args.decoding} decoding | compile {args.compile} | "
        f"median of {args.repeats} (+{args.warmup} warmup)"
    )
    rows = []
    for p in prompt_lens:
        decode, mixed, alone = [], [], []
        for i in range(args.warmup + args.repeats):
            times = (
                decode_step(mixed_engine, args.decoding),
                mixed_step(mixed_engine, prompt(p), args.decoding),
                alone_prefill(idle_engine, prompt(p)),
            )
            if i >= args.warmup:
                for store, t in zip((decode, mixed, alone), times):
                    store.append(t)
        med = {k: statistics.median(v) for k, v in (("decode", decode), ("mixed", mixed), ("alone", alone))}
        per_repeat = [m / (d + a) for d, m, a in zip(decode, mixed, alone)]
        row = {
            "prompt_len": p,
            "composition": f"{args.decoding} decode rows + 1 prefill chunk of {p} tokens ({args.decoding + p} tokens)",
            "decode_ms": med["decode"] * 1e3,
            "alone_prefill_ms": med["alone"] * 1e3,
            "mixed_ms": med["mixed"] * 1e3,
            "ratio": med["mixed"] / (med["decode"] + med["alone"]),
            "ratio_min": min(per_repeat),
            "ratio_max": max(per_repeat),
            "decode_times_s": decode,
            "alone_prefill_times_s": alone,
            "mixed_times_s": mixed,
        }
        rows.append(row)
        print(f"  P={p}: {row['composition']}, ratio {row['ratio']:.3f}", flush=True)

    print(f"\nthreads {torch.get_num_threads()}; ratio = mixed / (decode + prefill alone), target <= 1.3")
    head = f"{'prompt':>6} | {'decode ms':>9} | {'prefill ms':>10} | {'mixed ms':>9} | {'ratio':>6} | {'min..max':>11}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['prompt_len']:>6} | {r['decode_ms']:>9.2f} | {r['alone_prefill_ms']:>10.2f} | {r['mixed_ms']:>9.2f} | "
            f"{r['ratio']:>6.3f} | {r['ratio_min']:>5.2f}..{r['ratio_max']:<5.2f}"
        )

    write_result(
        args.out,
        "mixed_step",
        model=str(path),
        model_family=raw.get("model_type"),
        decoding=args.decoding,
        engine_options=options,
        warmup=args.warmup,
        repeats=args.repeats,
        results=rows,
    )


if __name__ == "__main__":
    main()
