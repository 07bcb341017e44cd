"""LoRA serving cost: offline generation of the embedded model with adapters on every row (one adapter, and a
mix of base and two adapters in each step) against the same engine serving the base alone, and against an engine
started without --enable-lora.

Each configuration runs the same `--batch` prompts to `--tokens` greedy tokens (prefill and decode steps); the
configurations alternate within each repeat so machine noise hits them alike; the prefix cache is off so every
repeat computes the same work. Ratio = median(configuration) / median(no LoRA engine).

    .venv/bin/python benchmarks/lora_serving.py --threads 2 --batch 8 --tokens 32 --rank 16 --repeats 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from report import write_result

from kestrel.engine.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.builtin import builtin_model_path
from kestrel.models.loader import load_model
from kestrel.models.lora import lora_targets
from kestrel.train.lora import new_adapter, save_adapter

RESULTS = Path(__file__).resolve().parent / "results" / "lora_serving.json"


def write_adapters(root: Path, rank: int) -> list[str]:
    """Two adapters on every LoRA-targetable projection (B random: a zero B would still cost the same flops)."""
    model, cfg = load_model(builtin_model_path())
    targets = sorted({m.rsplit(".", 1)[-1] for m in lora_targets(model)})
    entries = []
    for i, name in enumerate(("a1", "a2")):
        adapter = new_adapter(model, targets, r=rank, lora_alpha=2.0 * rank, name=name, seed=i)
        gen = torch.Generator().manual_seed(10 + i)
        for m, (a, b) in adapter.weights.items():
            adapter.weights[m] = (a, torch.randn(b.shape, generator=gen) * 0.01)
        entries.append(f"{name}={save_adapter(adapter, root / name, cfg.model_type)}")
    return entries


def run(engine: Engine, prompts: list[list[int]], loras: list[str | None], tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for p, lo in zip(prompts, loras):
        engine.add_request(p, params, lora_name=lo)
    while engine.has_unfinished:
        engine.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--batch", type=int, default=8, help="requests per run (all admitted at once)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    common = dict(model=None, dtype="float32", device="cpu", max_total_tokens=16384, enable_prefix_caching=False)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Engine(EngineConfig(**common))
        lora = Engine(EngineConfig(**common, lora_paths=write_adapters(Path(tmp), args.rank)))
    gen = torch.Generator().manual_seed(0)
    vocab = plain.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    b = args.batch
    configs = {
        "no LoRA engine": (plain, [None] * b),
        "LoRA engine, base rows": (lora, [None] * b),
        "one adapter, every row": (lora, ["a1"] * b),
        "mixed: base, a1, a2": (lora, [(None, "a1", "a2")[i % 3] for i in range(b)]),
    }
    for engine, loras in configs.values():  # warm-up
        run(engine, prompts, loras, args.tokens)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, (engine, loras) in configs.items():
            times[name].append(run(engine, prompts, loras, args.tokens))
    base = statistics.median(times["no LoRA engine"])
    print(f"threads={torch.get_num_threads()} batch={b} prompt={args.prompt_len} tokens={args.tokens} rank={args.rank}")
    print(f"{'configuration':<26} {'median s':>9} {'ratio':>7}")
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"median_s": med, "ratio": med / base, "runs_s": ts}
        print(f"{name:<26} {med:>9.3f} {med / base:>7.2f}")
    write_result(
        args.out,
        "lora_serving",
        machine=platform.processor(),
        batch=b,
        prompt_len=args.prompt_len,
        tokens=args.tokens,
        rank=args.rank,
        repeats=args.repeats,
        results=rows,
    )


if __name__ == "__main__":
    main()
