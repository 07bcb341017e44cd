"""Zero-mismatch mode: how far the engine's rollout logprobs are from a trainer's recomputation, and what
`--deterministic-inference` costs.

Per family (random checkpoints of the `--size` preset, fp32): `--requests` sampled rollouts of mixed prompt lengths,
all admitted at once (batched decode, chunked prefill of `--chunk` tokens), then a trainer forward over every rollout
packed in one batch. The mismatch table is max / mean |engine − trainer| logprob over every sampled token, normal
mode (trainer in normal mode) vs deterministic mode (both batch-invariant). The speed rows time the same generation
(prefix cache off, so every repeat computes the same work) and the trainer's forward + backward in each mode; modes
alternate within each repeat so machine noise hits them alike. Ratio = median(deterministic) / median(normal).

    .venv/bin/python benchmarks/deterministic_inference.py --threads 1 --size tiny --requests 8 --tokens 16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from report import write_result

from kestrel.engine.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.checkpoint import make_model
from kestrel.models.loader import load_model
from kestrel.train.routing_replay import Rollout, logprob_mismatch, sequence_logprobs

RESULTS = Path(__file__).resolve().parent / "results" / "deterministic_inference.json"
MODES = ("normal", "deterministic")


def rollouts(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[list[Rollout], float]:
    """Sampled rollouts of every prompt (all admitted together) and the generation's wall time."""
    t0 = time.perf_counter()
    ids = []
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, logprobs=0, ignore_eos=True)
        ids.append((engine.add_request(p, params), p))
    done = {}
    while engine.has_unfinished:
        for out in engine.step().finished:
            done[out.request_id] = out
    seconds = time.perf_counter() - t0
    return [Rollout.from_output(p, done[rid].outputs[0]) for rid, p in ids], seconds


def train_step_seconds(model, batch: list[Rollout]) -> float:
    t0 = time.perf_counter()
    torch.cat(sequence_logprobs(model, batch, replay=False)).sum().backward()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--families", default="kimi_linear,deepseek_v32,kimi_k3")
    ap.add_argument("--size", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48, help="longest prompt (the others are shorter)")
    ap.add_argument("--tokens", type=int, default=16, help="sampled tokens per request")
    ap.add_argument("--chunk", type=int, default=32, help="chunked-prefill size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    common = dict(dtype="float32", device="cpu", max_total_tokens=16384, chunked_prefill_size=args.chunk)
    gen = torch.Generator().manual_seed(0)
    lengths = [max(2, args.prompt_len * (i + 1) // args.requests) for i in range(args.requests)]
    results = {}
    print(f"threads={torch.get_num_threads()} size={args.size} requests={args.requests} prompts<={args.prompt_len}")
    print(f"tokens={args.tokens} chunk={args.chunk} repeats={args.repeats}")
    header = f"{'family':<13} {'mode':<14} {'max |dlp|':>10} {'mean |dlp|':>11} {'gen s':>8} {'train s':>8}"
    print(header)
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path = str(make_model(family, args.size, Path(tmp) / family, seed=0))
            engines = {
                m: Engine(EngineConfig(model=path, **common, deterministic_inference=m != "normal")) for m in MODES
            }
            trainers = {}
            for m in MODES:
                trainers[m], _ = load_model(path, torch.float32, torch.device("cpu"))
                trainers[m].batch_invariant = m != "normal"
        vocab = engines["normal"].model_config.vocab_size
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
        row: dict[str, dict] = {}
        for m in MODES:  # mismatch (also the warm-up of both paths)
            batch, _ = rollouts(engines[m], prompts, args.tokens)
            row[m] = logprob_mismatch(batch, sequence_logprobs(trainers[m], batch, replay=False))
            row[m]["batch"] = batch
        times = {m: {"generate_s": [], "train_s": []} for m in MODES}
        for _ in range(args.repeats):
            for m in MODES:
                engines[m].cache.clear()
                times[m]["generate_s"].append(rollouts(engines[m], prompts, args.tokens)[1])
                trainers[m].zero_grad(set_to_none=True)
                times[m]["train_s"].append(train_step_seconds(trainers[m], row[m]["batch"]))
        out = {}
        for m in MODES:
            med = {k: statistics.median(v) for k, v in times[m].items()}
            stats = {k: v for k, v in row[m].items() if k != "batch"}
            out[m] = {**stats, **{f"median_{k}": v for k, v in med.items()}, "runs": times[m]}
            print(f"{family:<13} {m:<14} {stats['max_abs']:>10.3g} {stats['mean_abs']:>11.3g} "
                  f"{med['generate_s']:>8.3f} {med['train_s']:>8.3f}")  # fmt: skip
        gen_ratio = out["deterministic"]["median_generate_s"] / out["normal"]["median_generate_s"]
        train_ratio = out["deterministic"]["median_train_s"] / out["normal"]["median_train_s"]
        out["ratio_generate"], out["ratio_train"] = gen_ratio, train_ratio
        print(f"{family:<13} {'det / normal':<14} {'':>10} {'':>11} {gen_ratio:>7.2f}x {train_ratio:>7.2f}x")
        results[family] = out
    write_result(
        args.out,
        "deterministic_inference",
        size=args.size,
        requests=args.requests,
        prompt_lengths=lengths,
        tokens=args.tokens,
        chunk=args.chunk,
        repeats=args.repeats,
        results=results,
    )


if __name__ == "__main__":
    main()
