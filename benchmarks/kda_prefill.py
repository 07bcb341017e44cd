"""KDA prefill throughput: Kestrel's `kda_chunked` vs transformers' torch `chunk_kimi_delta_attention`.

Same inputs, same chunk size (64), fp32, forward only. Reports median tokens/s over --repeats timed runs (after one
warmup each), the kestrel/transformers speed ratio, and the max abs difference between the two outputs. Writes JSON to
benchmarks/results/kda_prefill.json.

    .venv/bin/python benchmarks/kda_prefill.py --threads 2 --lengths 1024 4096
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from report import write_result
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

from kestrel.models.layers.kda_ops import kda_chunked, l2_normalize

RESULTS = Path(__file__).resolve().parent / "results" / "kda_prefill.json"
CHUNK = 64


def make_inputs(T: int, H: int, D: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Raw q/k/v plus Kimi-style gates (g = -exp(A_log) * softplus(.), beta = sigmoid(.)), batch 1."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    return {
        "q": rand(1, T, H, D),
        "k": rand(1, T, H, D),
        "v": rand(1, T, H, D),
        "g": -(rand(H, 1) * 0.5 - 1.5).exp() * F.softplus(rand(1, T, H, D)),
        "beta": torch.sigmoid(rand(1, T, H)),
    }


def run_kestrel(x: dict[str, torch.Tensor]) -> torch.Tensor:
    # Kestrel's kernel takes pre-normalised q/k (the layer does it); include that cost so the work is identical.
    D = x["q"].shape[-1]
    q = l2_normalize(x["q"]) * D**-0.5
    k = l2_normalize(x["k"])
    return kda_chunked(q, k, x["v"], x["g"], x["beta"], chunk_size=CHUNK)[0]


def run_transformers(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return chunk_kimi_delta_attention(
        x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=CHUNK, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )[0]  # fmt: skip


def time_it(fn, x: dict[str, torch.Tensor], repeats: int) -> tuple[float, list[float], torch.Tensor]:
    """One warmup call, then `repeats` timed calls; returns (median seconds, all seconds, output)."""
    with torch.inference_mode():
        out = fn(x)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="sequence lengths T")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per (impl, T), after one warmup")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--heads", type=int, default=4, help="KDA heads H (Kimi-Linear has 32)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim K = V")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__} | transformers {transformers.__version__} | threads {torch.get_num_threads()} | "
        f"B=1 H={args.heads} K=V={args.head_dim} chunk={CHUNK} fp32 | repeats {args.repeats} (+1 warmup)"
    )

    rows = []
    for T in args.lengths:
        x = make_inputs(T, args.heads, args.head_dim)
        t_kes, all_kes, o_kes = time_it(run_kestrel, x, args.repeats)
        t_tf, all_tf, o_tf = time_it(run_transformers, x, args.repeats)
        rows.append(
            {
                "T": T,
                "kestrel_tok_s": T / t_kes,
                "transformers_tok_s": T / t_tf,
                "ratio": t_tf / t_kes,
                "kestrel_median_s": t_kes,
                "transformers_median_s": t_tf,
                "kestrel_times_s": all_kes,
                "transformers_times_s": all_tf,
                "max_abs_diff": (o_kes - o_tf.float()).abs().max().item(),
            }
        )

    print(f"\n{'T':>6} | {'kestrel tok/s':>14} | {'transformers tok/s':>18} | {'ratio':>7} | {'max|diff|':>9}")
    print("-" * 68)
    for r in rows:
        print(
            f"{r['T']:>6} | {r['kestrel_tok_s']:>14,.0f} | {r['transformers_tok_s']:>18,.0f} | "
            f"{r['ratio']:>6.2f}x | {r['max_abs_diff']:>9.2e}"
        )

    write_result(
        args.out,
        "kda_prefill",
        transformers=transformers.__version__,
        batch=1,
        heads=args.heads,
        head_dim=args.head_dim,
        chunk_size=CHUNK,
        dtype="float32",
        repeats=args.repeats,
        results=rows,
    )


if __name__ == "__main__":
    main()
