"""Where an engine step's time goes: wall time of prefill, decode and verify steps split by component, one run.

Two workloads, the ones the engine-core and DFlash targets are measured on:
  throughput  32 concurrent requests of 128-512 random tokens, 64 new each, on a checkpoint (default: make-model
              kimi_linear small, as offline_throughput.py), 2 threads;
  verify      the embedded model at concurrency 1 on held-out chat prompts, plain and with DFlash (block 7), 1 thread.

Components are timed by wrapping the layers' methods (KDA projections, chunked kernel, short-segment loop, decode
recurrence, output; MLA; MoE and its routed experts; the speculator's propose / commit / context extension), so the
figures are inclusive wall times of those calls; "other" is the step's wall time outside the top-level ones
(embedding, norms, AttnRes, LM head, scheduling, sampling, bookkeeping). The wrappers cost ~1 us a call: compare
shares, not absolute times, and quote medians of repeated runs on this shared machine.

    .venv/bin/python benchmarks/step_breakdown.py --workload throughput
    .venv/bin/python benchmarks/step_breakdown.py --workload verify
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from offline_throughput import make_prompts
from report import write_result

RESULTS = Path(__file__).resolve().parent / "results"
HELD_OUT_SEED = 20_000


class ComponentClock:
    """Inclusive wall time per labelled method, accumulated until `take()`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)
        if name == "forward" and vars(owner).get("__call__") is inner:  # HooklessModule calls forward directly
            owner.__call__ = timed

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


TOP_LEVEL = ("kda", "mla", "moe", "spec.propose", "spec.commit")  # disjoint: "other" is the rest


def instrument(clock: ComponentClock) -> None:
    from kestrel.models.layers import kda, kda_kernel, mla, moe
    from kestrel.spec import speculator

    for owner, name, label in [
        (kda.KDAAttention, "forward", "kda"),
        (kda.KDAAttention, "project", "kda.project"),
        (kda.KDAAttention, "prefill_packed", "kda.prefill"),
        (kda.KDAAttention, "packed_qkv", "kda.prefill.conv_qkv"),
        (kda, "kda_chunked_packed", "kda.prefill.chunked_form"),
        (kda_kernel, "varlen", "kda.prefill.kernel_loop"),
        (kda.KDAAttention, "short_segments", "kda.short_segments"),
        (kda.KDAAttention, "decode", "kda.decode_step"),
        (kda.KDAAttention, "_output", "kda.output"),
        (mla.MLAAttention, "forward", "mla"),
        (moe.MoE, "forward", "moe"),
        (moe.Router, "forward", "moe.router"),
        (moe.Experts, "forward", "moe.routed_experts"),
        (moe.DenseMLP, "forward", "dense_mlp"),  # dense layers (in "other") and shared experts (inside moe)
        (speculator.DFlashSpeculator, "propose", "spec.propose"),
        (speculator.DFlashSpeculator, "commit", "spec.commit"),
        (speculator.DFlashSpeculator, "_extend_context", "spec.commit.extend_context"),
    ]:
        clock.wrap(owner, name, label)


def run_steps(engine, clock: ComponentClock) -> list[tuple[float, dict[str, float]]]:
    """Step the engine until idle: (wall seconds, component seconds) per step."""
    steps = []
    while engine.has_unfinished:
        clock.take()
        start = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - start, clock.take()))
    return steps


def summarise(name: str, steps, is_kind: Callable) -> dict:
    picked = [s for s in steps if is_kind(s)]
    if not picked:
        return {}
    wall = sum(s[0] for s in picked)
    parts: dict[str, float] = collections.defaultdict(float)
    for _, seconds in picked:
        for label, value in seconds.items():
            parts[label] += value
    top = sum(v for k, v in parts.items() if k in TOP_LEVEL)
    rows = {k: parts[k] for k in sorted(parts)} | {"other": wall - top}
    print(
        f"{name}: {len(picked)} steps, {wall:.3f} s, median step {statistics.median(s[0] for s in picked) * 1e3:.1f} ms"
    )
    for label, value in rows.items():
        print(f"  {label:<30} {value:8.3f} s  {100 * value / wall:5.1f}%")
    return {"steps": len(picked), "wall_s": wall, "parts_s": rows}


def throughput(args, clock: ComponentClock) -> dict:
    from kestrel import LLM, SamplingParams
    from kestrel.models.checkpoint import make_model

    path = args.model or str(make_model("kimi_linear", "small", Path(tempfile.mkdtemp()) / "kl-small", seed=0))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.num_prompts, 128, 512, vocab, seed=0)  # offline_throughput's prompts
    llm = LLM(
        path,
        max_total_tokens=sum(len(p) + args.new_tokens for p in prompts) + 1024,
        max_running_requests=len(prompts),
        max_num_batched_tokens=4096,
        chunked_prefill_size=1024,
        num_threads=args.threads,
    )
    engine = llm.engine
    engine.add_request(prompts[0][:64], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    run_steps(engine, clock)
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    steps = run_steps(engine, clock)
    prefill = summarise("prefill steps (any prompt token)", steps, lambda s: "kda.prefill" in s[1])
    decode = summarise("decode steps", steps, lambda s: "kda.prefill" not in s[1])
    total = sum(s[0] for s in steps)
    print(f"total {total:.2f} s, {len(prompts) * args.new_tokens / total:.1f} output tok/s")
    return {"model": path, "prefill": prefill, "decode": decode, "total_s": total}


def verify(args, clock: ComponentClock) -> dict:
    from kestrel.engine.llm import LLM
    from kestrel.engine.sampling_params import SamplingParams
    from kestrel.train.dflash import chat_prompts

    prompts = chat_prompts(HELD_OUT_SEED, args.num_prompts)
    common = dict(max_running_requests=1, dtype="float32", max_total_tokens=65536, num_threads=args.threads)
    out = {}
    for mode, extra in [
        ("plain", {}),
        ("dflash", dict(speculative_algorithm="dflash", speculative_num_draft_tokens=7)),
    ]:
        engine = LLM(None, **common, **extra).engine
        engine.add_request(engine.encode(prompts[0]), SamplingParams(temperature=0, max_tokens=8))  # warm-up
        run_steps(engine, clock)
        steps = []
        for p in prompts:
            engine.add_request(engine.encode(p), SamplingParams(temperature=0, max_tokens=args.new_tokens))
            steps += run_steps(engine, clock)[1:]  # the prompt's prefill step is the same in both modes
        out[mode] = summarise(f"{mode}: steps after the prompt's prefill", steps, lambda s: True)
        if mode == "dflash":
            out[mode]["accept_length"] = engine.spec.stats()["spec_accept_length"]
            print(f"  acceptance length {out[mode]['accept_length']:.2f}")
    ratio = out["plain"]["wall_s"] / out["dflash"]["wall_s"]
    print(f"decode-phase speed-up of dflash: {ratio:.2f}x")
    return out | {"decode_phase_speedup": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["throughput", "verify"], default="throughput")
    ap.add_argument("--threads", type=int, default=None, help="default: 2 (throughput), 1 (verify)")
    ap.add_argument("--model", default=None, help="throughput checkpoint (default: make-model kimi_linear small)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 32 (throughput), 8 (verify)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 64 (throughput), 160 (verify)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    is_verify = args.workload == "verify"
    args.threads = args.threads or (1 if is_verify else 2)
    args.num_prompts = args.num_prompts or (8 if is_verify else 32)
    args.new_tokens = args.new_tokens or (160 if is_verify else 64)
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}, workload {args.workload}")
    clock = ComponentClock()
    instrument(clock)
    result = (verify if is_verify else throughput)(args, clock)
    write_result(args.out or RESULTS / f"step_breakdown_{args.workload}.json", "step_breakdown", **result)


if __name__ == "__main__":
    main()
