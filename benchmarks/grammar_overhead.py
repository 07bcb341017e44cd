"""Grammar overhead: a decode step of the embedded model with every request constrained by a JSON schema, against
the same step with none constrained (and with half).

xgrammar adds per-step CPU work (fill each row's token bitmask, mask the constrained logits, advance the matcher),
so the ratio is what structured output costs a decoding batch. Each configuration has its own engine holding
`--batch` requests decoding; a request that finishes (a constrained one ends when its JSON closes) is replaced and
the new one prefilled in untimed steps, so every timed step is a pure decode step of exactly `--batch` rows. The
configurations alternate within each repeat so machine noise hits them alike.
Ratio = median(constrained step) / median(unconstrained step).

    .venv/bin/python benchmarks/grammar_overhead.py --threads 2 --batch 8 --steps 20 --repeats 5
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import time
from pathlib import Path

import torch
from report import write_result

from kestrel.chat_template import render_chat
from kestrel.engine.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "grammar_overhead.json"
SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": -5, "maximum": 99},
    },
    "required": ["word", "count"],
    "additionalProperties": False,
}
TOPICS = ["a cat", "the sea", "15% of 240", "a person", "rain", "numbers", "a city", "music", "bread", "time"]
MAX_TOKENS = 512


class Batch:
    """One engine kept at `size` decoding requests, the first `constrained` of each refill holding the grammar."""

    def __init__(self, size: int, constrained: int, grammar_kind: str) -> None:
        self.engine = Engine(
            EngineConfig(model=None, dtype="float32", device="cpu", max_total_tokens=16384, max_model_len=2048)
        )
        self.grammar = self.engine.grammar.compile(grammar_kind, SCHEMA) if constrained else None
        self.size, self.constrained = size, constrained
        self.live: dict[str, bool] = {}  # request id -> constrained
        self.prompts = itertools.cycle(TOPICS)
        self.seeds = itertools.count()
        self.refill()

    def refill(self) -> None:
        """Replace finished requests (keeping `constrained` of them constrained) and prefill them, untimed."""
        while len(self.live) < self.size or not self.decoding():
            if len(self.live) == self.size:
                self.forget(self.engine.step().finished)  # a finished request is replaced on the next pass
                continue
            grammar = self.grammar if sum(self.live.values()) < self.constrained else None
            prompt = render_chat([{"role": "user", "content": f"Answer in JSON about {next(self.prompts)}."}])
            # Unconstrained rows ignore eos so only a grammar (or max_tokens) ends a request.
            params = SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, seed=next(self.seeds), grammar=grammar, ignore_eos=not grammar
            )
            self.live[self.engine.add_request(prompt, params)] = grammar is not None

    def decoding(self) -> bool:
        sched = self.engine.scheduler
        return not sched.waiting and len(sched.running) == self.size and all(r.output_ids for r in sched.running)

    def forget(self, finished) -> None:
        for out in finished:
            self.live.pop(out.request_id, None)

    def timed_step(self) -> float:
        """One pure decode step of `size` rows; each advances by exactly one token."""
        running = self.engine.scheduler.running
        before = {id(r): r.computed_len for r in running}
        assert len(running) == self.size and not self.engine.scheduler.waiting, "not a full decode batch"
        t0 = time.perf_counter()
        out = self.engine.step()
        seconds = time.perf_counter() - t0
        assert all(r.computed_len == before[id(r)] + 1 for r in self.engine.scheduler.running), "not a decode step"
        self.forget(out.finished)
        self.refill()
        return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--batch", type=int, default=8, help="requests decoding in every timed step")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration per repeat")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps per configuration first")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-half", action="store_true", help="skip the half-constrained configuration")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    constrained = {"none": 0, "all": args.batch} | ({} if args.no_half else {"half": args.batch // 2})
    batches = {name: Batch(args.batch, n, "json_schema") for name, n in constrained.items()}
    for b in batches.values():
        for _ in range(args.warmup):
            b.timed_step()

    times: dict[str, list[float]] = {name: [] for name in batches}
    per_repeat: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(args.repeats):
        for name, b in batches.items():
            steps = [b.timed_step() for _ in range(args.steps)]
            times[name] += steps
            per_repeat[name].append(statistics.median(steps))

    print(
        f"torch {torch.__version__} | threads {torch.get_num_threads()} | {platform.machine()} | embedded model | "
        f"batch {args.batch} decoding | {args.steps} steps x {args.repeats} repeats (+{args.warmup} warmup) | "
        f"schema: object{{word: string<=8, count: int -5..99}}"
    )
    base = statistics.median(times["none"])
    rows = []
    for name, b in batches.items():
        med = statistics.median(times[name])
        ratios = [m / n for m, n in zip(per_repeat[name], per_repeat["none"])]
        rows.append(
            {
                "config": name,
                "constrained_rows": b.constrained,
                "batch": args.batch,
                "median_ms": med * 1e3,
                "ratio": med / base,
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "step_times_s": times[name],
            }
        )
    print(f"\nthreads {torch.get_num_threads()}; ratio = median constrained step / median unconstrained step")
    head = f"{'constrained':>11} | {'rows':>4} | {'ms/step':>8} | {'ratio':>6} | {'repeats min..max':>16}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['config']:>11} | {r['constrained_rows']:>2}/{r['batch']:<1} | {r['median_ms']:>8.2f} | "
            f"{r['ratio']:>6.3f} | {r['ratio_min']:>7.3f}..{r['ratio_max']:<7.3f}"
        )

    write_result(
        args.out,
        "grammar_overhead",
        model="embedded",
        schema=SCHEMA,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        results=rows,
    )


if __name__ == "__main__":
    main()
