"""KDA prefill: the token loop (`kda_steps`) vs the chunked form (`kda_chunked_packed`) by prompt length and count.

Why `RECURRENT_MAX_TOKENS` in kestrel/models/layers/kda.py is what it is: the loop's cost grows with the longest
sequence (six small ops a token, each over every sequence at once), the chunked form's with the number of 64-token
chunks (a full chunk's work even for a 17-token prompt). Random inputs at the models' KDA shape (64 x 64 heads);
medians of repeated calls, both forms in the same run; read the chunked/loop column (> 1: the loop wins).

    .venv/bin/python benchmarks/kda_forms.py --threads 1 --heads 4     # kestrel-mini's KDA layers
    .venv/bin/python benchmarks/kda_forms.py --threads 2 --heads 6     # make-model small
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from report import write_result
from timing import median_seconds

from kestrel.models.layers.kda import CHUNK_SIZE
from kestrel.models.layers.kda_ops import kda_chunked_packed, kda_steps

RESULTS = Path(__file__).resolve().parent / "results" / "kda_forms.json"


def forms(b: int, t: int, heads: int, dim: int, seed: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """The two forms over b sequences of t tokens each, from random initial states."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, heads, dim, generator=gen) * 0.1
    k = F.normalize(torch.randn(b, t, heads, dim, generator=gen), dim=-1)
    v = torch.randn(b, t, heads, dim, generator=gen)
    g = -torch.rand(b, t, heads, dim, generator=gen)
    beta = torch.rand(b, t, heads, generator=gen)
    state = torch.randn(b, heads, dim, dim, generator=gen) * 0.1
    pad, chunks = (-t) % CHUNK_SIZE, -(-t // CHUNK_SIZE)

    def packed(x: torch.Tensor) -> torch.Tensor:  # [b, t, ...] -> [b * chunks * C, ...], each sequence chunk-aligned
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(b * (t + pad), *x.shape[2:])

    flat = [packed(x) for x in (q, k, v, g, beta)]
    firsts = [i * chunks for i in range(b)]
    ends = [f + chunks - 1 for f in firsts]
    return (lambda: kda_steps(q, k, v, g, beta, state)), (lambda: kda_chunked_packed(*flat, state, firsts, ends))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--sequences", default="1,4,32")
    ap.add_argument("--tokens", default="16,24,32,48,64,256")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}, {args.heads} heads of {args.head_dim}, chunk {CHUNK_SIZE}")
    print(f"{'seqs':>5} {'tokens':>7} {'loop ms':>9} {'chunked ms':>11} {'chunked/loop':>13}")
    rows = []
    with torch.inference_mode():
        for b in map(int, args.sequences.split(",")):
            for t in map(int, args.tokens.split(",")):
                loop, chunked = forms(b, t, args.heads, args.head_dim, seed=b * 1000 + t)
                lm, cm = median_seconds(loop, args.repeats, 2) * 1e3, median_seconds(chunked, args.repeats, 2) * 1e3
                rows.append(dict(sequences=b, tokens=t, loop_ms=round(lm, 3), chunked_ms=round(cm, 3)))
                print(f"{b:>5} {t:>7} {lm:>9.2f} {cm:>11.2f} {cm / lm:>12.2f}x")
    write_result(RESULTS, "kda_forms", heads=args.heads, head_dim=args.head_dim, rows=rows)


if __name__ == "__main__":
    main()
