"""Bytes one DSA decode step moves to merge the top-k under decode context parallelism: the candidate merge
(each rank sends its best C (score, position) keys, plus a rank's full local top-k where the fallback fires)
against gathering every rank's full local top-k.

Index scores come from the DSA indexer formula at K3.1's widths (64 heads x 128, random unit-RMS keys and
queries, softmax-like positive head weights) over each context; ranks are simulated in this process (the same
merge functions the gloo path runs, `kestrel.dist.dcp.simulate_topk`), and every merged top-k is checked
against the single-rank top-k. Both sides count 8 bytes per (score, position) key, summed over ranks.

    .venv/bin/python benchmarks/dcp_topk_merge.py --contexts 16384 65536 262144 --worlds 2 4 8

Writes benchmarks/results/dcp_topk_merge.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from report import write_result

from kestrel.dist import dcp

KEY_BYTES = 8


def index_scores(rows: int, length: int, heads: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Score(s) = sum_h w_h ReLU(q_h . k_s) / sqrt(H D) for `rows` queries over `length` keys, in blocks."""
    q = torch.randn(rows, heads, dim, generator=gen)
    w = torch.rand(rows, heads, generator=gen) * (heads * dim) ** -0.5
    out = torch.empty(rows, length)
    for start in range(0, length, 16384):
        keys = torch.randn(min(16384, length - start), dim, generator=gen)
        relu = torch.einsum("rhd,ld->rhl", q, keys).relu_()
        out[:, start : start + keys.shape[0]] = torch.einsum("rh,rhl->rl", w, relu)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 65536, 262144])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--candidates", type=int, nargs="+", default=[384, 768], help="C: keys each rank sends first")
    ap.add_argument("--rows", type=int, default=4, help="decode rows (queries) per step")
    ap.add_argument("--index-heads", type=int, default=64)
    ap.add_argument("--index-dim", type=int, default=128)
    ap.add_argument("--interleave", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "dcp_topk_merge.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}  top-k {args.topk}  rows {args.rows}  interleave {args.interleave}")
    head = ("context", 8), ("N", 3), ("C", 5), ("full top-k B", 13), ("merge B", 10), ("ratio", 7), ("fallback", 9)
    print(" ".join(f"{name:>{width}}" for name, width in head), f"{'pairs':>6}")
    table = []
    for length in args.contexts:
        scores = index_scores(args.rows, length, args.index_heads, args.index_dim, gen)
        lengths = torch.full((args.rows,), length)
        ref = dcp.exact_topk(scores, lengths, args.topk)[1]
        for world, cands in ((w, c) for w in args.worlds for c in args.candidates):
            got, stats = dcp.simulate_topk(scores, lengths, args.topk, cands, world, args.interleave)
            if not torch.equal(got, ref):
                raise AssertionError(f"merged top-k differs from the single-rank top-k at L={length}, N={world}")
            # The baseline: every rank sends its whole local top-k (all its tokens when it holds fewer than k).
            per_rank = [int(dcp.shard_count(lengths[:1], r, world, args.interleave)) for r in range(world)]
            full = args.rows * sum(min(args.topk, n) for n in per_rank) * KEY_BYTES
            merge = stats.candidate_bytes + stats.fallback_bytes
            row = {
                "context": length,
                "world": world,
                "candidates": cands,
                "full_topk_bytes": full,
                "merge_bytes": merge,
                "candidate_bytes": stats.candidate_bytes,
                "fallback_bytes": stats.fallback_bytes,
                "ratio": full / merge,
                "fallback_pairs": stats.fallback_pairs,
                "rank_rows": world * args.rows,
                "fallback_rate": stats.fallback_pairs / (world * args.rows),
            }
            table.append(row)
            print(
                f"{length:>8} {world:>3} {cands:>5} {full:>13} {merge:>10} {full / merge:>6.2f}x "
                f"{row['fallback_rate']:>8.1%} {stats.fallback_pairs:>6}"
            )
    write_result(args.out, "dcp_topk_merge", args=vars(args) | {"out": str(args.out)}, table=table)


if __name__ == "__main__":
    main()
