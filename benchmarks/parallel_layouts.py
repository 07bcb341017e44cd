"""Parallel layouts on one machine: per-rank weight and cache memory, prefill and decode time, bytes moved.

For each layout (one process; TP2; TP2·EP2; attention-DP2·TP2; PCP2; PP2; TP4; TP4·DCP4) the same small kimi_k3
checkpoint serves the same batch: `--batch` greedy requests of `--prompt-len` tokens are prefilled (timed, and the
bytes moved counted), then `--steps` pure decode steps are timed one by one. Rank 0 reports its parameter bytes, the
bytes of the KV pages and KDA state slots it allocated, the prefill time, the median decode step, and the bytes it
handed to collectives and point-to-point sends (counted in `kestrel.dist.comm`, by op: the step-plan broadcast, the
model's all-reduce / all-gather / all-to-all, PCP's all-gathered keys, halos and state maps, PP's residual sends).
Under PP rank 0 is stage 0 (half the layers; the other stage holds the rest, tests/test_dist_plan.py); under PCP
every rank holds the whole model. The closing table sets `kestrel plan`'s DCP8 vs TP8 full-context figure for
K3.1 Pro beside what the engine allocates per rank for the tiny kimi_k3 (its heads split 4 ways) under TP4·DCP4
vs TP4. On a 2-core machine
speed-ups are not expected: memory per rank and bytes per step are the figures; time ratios to one process are
printed for completeness.

    .venv/bin/python benchmarks/parallel_layouts.py --batch 8 --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from report import write_result

from kestrel import LLM, SamplingParams
from kestrel.dist import comm, memory
from kestrel.dist.engine_ranks import run_engine
from kestrel.engine.config import EngineConfig
from kestrel.models.checkpoint import make_model

RESULTS = Path(__file__).resolve().parent / "results" / "parallel_layouts.json"
LAYOUTS = {
    "1": dict(tp=1),
    "TP2": dict(tp=2),
    "TP2·EP2": dict(tp=2, ep=2),
    "DP-attn2·TP2": dict(tp=2, dp_attn=2),
    "PCP2": dict(pcp=2),
    "PP2": dict(pp=2),  # each step cut into 2 micro-batches: the stages overlap
    "PP2·1 micro-batch": dict(pp=2, pp_micro_batches=1),  # no overlap: the same run's baseline for PP2
}
# DCP 4 needs heads that split 4 ways: the tiny kimi_k3 (4 MLA / KDA heads; the small one has 6).
DCP_LAYOUTS = {"TP4": dict(tp=4), "TP4·DCP4": dict(tp=4, dcp=4)}


def measure(path: str, args: argparse.Namespace, layout: dict) -> dict:
    """Rank 0: prefill the batch, then time decode steps and count their collective bytes."""
    config = dict(max_total_tokens=4096, max_running_requests=args.batch, num_threads=args.threads, **layout)
    llm = LLM(path, **config)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for _ in range(args.batch):
        vocab = engine.model_config.vocab_size
        engine.add_request(torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist(), params)
    comm.reset_counters()
    t0 = time.perf_counter()
    while any(r.computed_len < len(r.prompt_ids) for r in [*engine.scheduler.running, *engine.scheduler.waiting]):
        engine.step()
    prefill_s, prefill_moved = time.perf_counter() - t0, dict(comm.BYTES)
    times, moved = [], []
    for _ in range(args.steps):
        comm.reset_counters()
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        moved.append(dict(comm.BYTES))
    runner = engine.runner
    cache = sum(t.numel() * t.element_size() for t in runner.kv._tensors())
    states = runner.states
    state_bytes = sum(t.numel() * t.element_size() for t in [*states.conv.values(), *states.recurrent.values()])
    ops = sorted({op for m in moved for op in m})
    result = {
        "weight_bytes_per_rank": memory.weight_bytes(engine.model),
        "kv_bytes_per_rank": cache,
        "kda_state_bytes_per_rank": state_bytes,
        "kv_bytes_per_token_per_rank": memory.kv_bytes_per_token(runner.kv),  # per pool row
        "kv_bytes_per_context_token": cache / ((runner.scratch_page + 1) * runner.page_size),  # DCP: a row is 1/dcp
        "kda_state_bytes_per_request_per_rank": memory.state_bytes_per_slot(states),
        "prefill_s": prefill_s,
        "bytes_moved_prefill": prefill_moved,
        "decode_step_s_median": statistics.median(times),
        "collective_bytes_per_decode_step": {op: statistics.median(m.get(op, 0) for m in moved) for op in ops},
    }
    while engine.has_unfinished:
        engine.step()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_model("kimi_k3", "small", Path(tmp) / "k3", seed=0))
        tiny = str(make_model("kimi_k3", "tiny", Path(tmp) / "k3-tiny", seed=0))
        for name, layout, model in [
            *((n, lay, path) for n, lay in LAYOUTS.items()),
            *((n, lay, tiny) for n, lay in DCP_LAYOUTS.items()),
        ]:
            config = EngineConfig(model=model, num_threads=args.threads, **layout)
            results[name] = run_engine(config, lambda layout=layout, model=model: measure(model, args, layout))
    base, base_prefill = results["1"]["decode_step_s_median"], results["1"]["prefill_s"]
    print(f"kimi_k3 small, batch {args.batch} x {args.prompt_len}-token prompts, {args.threads} thread(s) per rank")
    print(f"{'layout':<19}{'weights MB':>11}{'KV MB':>8}{'state MB':>9}{'prefill s':>10}{'x 1-proc':>9}", end="")
    print(f"{'MB moved':>9}{'step ms':>9}{'x 1-proc':>9}  bytes/decode step")
    for name, r in results.items():
        if name in DCP_LAYOUTS:
            continue
        moved = r["collective_bytes_per_decode_step"]
        by_op = ", ".join(f"{op} {int(b):,}" for op, b in moved.items()) or "-"
        print(
            f"{name:<19}{r['weight_bytes_per_rank'] / 1e6:>11.2f}{r['kv_bytes_per_rank'] / 1e6:>8.2f}"
            f"{r['kda_state_bytes_per_rank'] / 1e6:>9.2f}{r['prefill_s']:>10.2f}{r['prefill_s'] / base_prefill:>9.2f}"
            f"{sum(r['bytes_moved_prefill'].values()) / 1e6:>9.2f}{r['decode_step_s_median'] * 1e3:>9.1f}"
            f"{r['decode_step_s_median'] / base:>9.2f}  {int(sum(moved.values())):,} ({by_op})"
        )
    pp = results["PP2"]["prefill_s"] / results["PP2·1 micro-batch"]["prefill_s"]
    print(f"\nPP2 prefill with 2 micro-batches / with 1 (stage overlap, same run): {pp:.2f}")
    full = dcp_figures(results)
    print("\nDCP vs TP: the planner's K3.1 Pro full 1M-token contexts on 8 GB300, and this engine's per-rank KV pool")
    print(f"  plan  TP8 {full['plan_tp8_full_contexts']}  TP8·DCP8 {full['plan_dcp8_full_contexts']}")
    print(
        f"  engine (kimi_k3 tiny, 4096-token pool) KV bytes/token/rank TP4 {full['engine_tp4_kv_bytes_per_token']:,}"
        f"  TP4·DCP4 {full['engine_dcp4_kv_bytes_per_token']:,}  (x{full['engine_tp4_over_dcp4']:.2f});"
        f" pool MB TP4 {full['engine_tp4_kv_mb']:.2f}  TP4·DCP4 {full['engine_dcp4_kv_mb']:.2f}"
    )
    write_result(
        args.out,
        "parallel_layouts",
        model="kimi_k3 small",
        batch=args.batch,
        prompt_len=args.prompt_len,
        steps=args.steps,
        threads_per_rank=args.threads,
        layouts=results,
        dcp_vs_tp=full,
        pp2_prefill_two_over_one_micro_batch=pp,
    )


def dcp_figures(results: dict) -> dict:
    """`kestrel plan`'s full-context requests for K3.1 Pro at TP8 vs TP8·DCP8 (FP8 KV, 8 GB300), beside the engine's
    measured per-rank KV bytes for TP4 vs TP4·DCP4."""
    from kestrel.plan import Layout, kimi_k31_pro_config, plan

    k31 = kimi_k31_pro_config()
    tp4, dcp4 = results["TP4"], results["TP4·DCP4"]
    return {
        "plan_tp8_full_contexts": plan(k31, Layout()).full_context_requests,
        "plan_dcp8_full_contexts": plan(k31, Layout(dcp=8)).full_context_requests,
        "engine_tp4_kv_bytes_per_token": tp4["kv_bytes_per_context_token"],
        "engine_dcp4_kv_bytes_per_token": dcp4["kv_bytes_per_context_token"],
        "engine_tp4_over_dcp4": tp4["kv_bytes_per_context_token"] / dcp4["kv_bytes_per_context_token"],
        "engine_tp4_kv_mb": tp4["kv_bytes_per_rank"] / 1e6,
        "engine_dcp4_kv_mb": dcp4["kv_bytes_per_rank"] / 1e6,
    }


if __name__ == "__main__":
    main()
