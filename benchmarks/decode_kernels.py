"""Decode-step CPU kernels: MLA attention read from the KV pool and the routed-experts tiles vs the PyTorch forms.

Two levels, both forms alternating inside every repeat (the figure is a median, the ratio torch / kernel):
- ops, on kimi_linear small's shapes (6 heads, latent 128 + rope 32; 12 experts 384 -> 128, top-4): MLA decode
  attention of B rows with histories of 128-576 tokens in scattered pool slots (PyTorch: gather the padded histories,
  then bmm / softmax / bmm), and the routed experts of T tokens (PyTorch: sort, grouped GEMMs, scatter);
- the engine: a decode step of kimi_linear small at batch 32 (histories of 128-512 prompt tokens and growing), with
  both kernels on vs both replaced by the PyTorch forms in the same process.

    .venv/bin/python benchmarks/decode_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from report import write_result
from timing import median_seconds

from kestrel.models.layers import cpu_kernels, mla, moe

RESULTS = Path(__file__).resolve().parent / "results" / "decode_kernels.json"
HEADS, RANK, ROPE, SCALE = 6, 128, 32, 0.1
EXPERTS, HIDDEN, INTER, TOP_K = 12, 384, 128, 4


def mla_calls(batch: int, gen: torch.Generator) -> tuple[Callable, Callable]:
    lengths = torch.randint(128, 577, (batch,), generator=gen)
    width, pool_rows = int(lengths.max()), int(lengths.sum()) + 64
    latent, rope_key = torch.randn(pool_rows, RANK, generator=gen), torch.randn(pool_rows, ROPE, generator=gen)
    perm = torch.randperm(pool_rows, generator=gen)
    slots = torch.zeros(batch, width, dtype=torch.long)
    at = 0
    for i, n in enumerate(lengths.tolist()):  # every row's history in its own (scattered) slots, as pages are
        slots[i, :n] = perm[at : at + n]
        at += n
    q_latent = torch.randn(batch, HEADS, RANK, generator=gen) * 0.1
    q_rope = torch.randn(batch, HEADS, ROPE, generator=gen) * 0.1
    allowed = torch.arange(width)[None, :] < lengths[:, None]

    def torch_form():
        c = latent.index_select(0, slots.reshape(-1)).view(batch, width, RANK)
        k = rope_key.index_select(0, slots.reshape(-1)).view(batch, width, ROPE)
        scores = torch.bmm(q_latent, c.transpose(1, 2)) + torch.bmm(q_rope, k.transpose(1, 2))
        scores = (scores * SCALE).masked_fill(~allowed[:, None, :], float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1), c)

    kernel = cpu_kernels.module().mla_decode_fp32
    return torch_form, lambda: kernel(q_latent, q_rope, latent, rope_key, slots, lengths, SCALE)


def expert_calls(tokens: int, gen: torch.Generator) -> tuple[Callable, Callable]:
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.05
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.05
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen)

    def silu_act(gate, up):
        return F.silu(gate) * up

    return (
        lambda: moe.expert_segments(x, ids, weights, gate_up, down, "silu", 0.0, 0.0),
        lambda: moe.expert_pairs_kernel(x, ids, weights, gate_up, down, silu_act),
    )


def op_rows(repeats: int, calls: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    cases = [("mla", b, *mla_calls(b, gen)) for b in (1, 8, 32)]
    cases += [("experts", t, *expert_calls(t, gen)) for t in (1, 8, 32, 64)]
    rows = []
    for name, size, torch_form, kernel in cases:
        got: dict[str, list[float]] = {"torch": [], "kernel": []}
        for _ in range(repeats):
            got["torch"].append(median_seconds(torch_form, calls) * 1e6)
            got["kernel"].append(median_seconds(kernel, calls) * 1e6)
        t, k = statistics.median(got["torch"]), statistics.median(got["kernel"])
        label = f"batch {size}" if name == "mla" else f"{size * TOP_K} pairs"
        rows.append({"op": name, "size": label, "torch_us": t, "kernel_us": k, "ratio": t / k})
        print(f"  {name:8s} {label:10s} {t:9.1f} {k:9.1f} {t / k:7.2f}x")
    return rows


def engine_row(repeats: int, steps: int) -> dict:
    """Median decode step of kimi_linear small at batch 32, kernels on vs the PyTorch forms, alternating."""
    from offline_throughput import make_prompts

    from kestrel import LLM, SamplingParams
    from kestrel.models.checkpoint import make_model

    path = make_model("kimi_linear", "small", Path(tempfile.mkdtemp()) / "kl-small", seed=0)
    prompts = make_prompts(32, 128, 512, 4096, seed=0)
    budget = sum(len(p) for p in prompts) + 32 * (repeats * 2 * steps + 64) + 1024
    engine = LLM(str(path), max_total_tokens=budget, max_running_requests=32, max_num_batched_tokens=4096).engine
    params = SamplingParams(temperature=0, max_tokens=repeats * 2 * steps + 16, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while any(r.computed_len < len(r.prompt_ids) for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # the prompts' prefill
    real = (moe.KERNEL_MAX_PAIRS, mla.MLAAttention._attend_in_pool)

    def use(kernels: bool) -> None:
        moe.KERNEL_MAX_PAIRS = real[0] if kernels else 0
        mla.MLAAttention._attend_in_pool = real[1] if kernels else (lambda *args: None)

    got: dict[str, list[float]] = {"torch": [], "kernel": []}
    try:
        for _ in range(repeats):
            for name in ("torch", "kernel"):
                use(name == "kernel")
                got[name].append(median_seconds(engine.step, steps) * 1e3)
    finally:
        use(True)
    t, k = statistics.median(got["torch"]), statistics.median(got["kernel"])
    print(f"  engine decode step, batch 32: {t:.2f} ms (PyTorch forms) vs {k:.2f} ms (kernels): {t / k:.2f}x")
    return {"torch_ms": t, "kernel_ms": k, "ratio": t / k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--steps", type=int, default=5, help="engine decode steps per configuration and repeat")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    if cpu_kernels.module() is None:
        raise SystemExit("the CPU kernels are unavailable here (no compiler, or KESTREL_CPU_KERNELS=0)")
    print(f"  {'op':8s} {'size':10s} {'torch us':>9s} {'kernel us':>9s} {'ratio':>8s}")
    with torch.inference_mode():
        ops = op_rows(args.repeats, args.calls)
    engine = engine_row(args.repeats, args.steps)
    write_result(args.out, "decode_kernels", ops=ops, engine=engine)


if __name__ == "__main__":
    main()
