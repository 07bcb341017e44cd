"""KDA's token loop: the PyTorch ops vs the compiled CPU loop (`kestrel/models/layers/kda_kernel.py`), one run.

Shapes of kestrel-mini's KDA layers (4 heads, K = V = 64): a decode step at batch 1 and 32, and verify blocks of 7
tokens at batch 1 and 4. Both forms alternate inside every repeat; the figure is the median microseconds a call and
the ratio torch / kernel.

    .venv/bin/python benchmarks/kda_kernel.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from report import write_result

from kestrel.models.layers import cpu_kernels
from kestrel.models.layers.kda_ops import kda_step, kda_steps

RESULTS = Path(__file__).resolve().parent / "results" / "kda_kernel.json"


def inputs(b: int, t: int, h: int = 4, d: int = 64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(b * 100 + t)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    q = F.normalize(rand(b, t, h, d), dim=-1) * d**-0.5
    k = F.normalize(rand(b, t, h, d), dim=-1)
    return q, k, rand(b, t, h, d), -F.softplus(rand(b, t, h, d)) * 0.2, torch.sigmoid(rand(b, t, h)), rand(b, h, d, d)


def make_call(q, k, v, g, beta, state):
    """A decode step (one token: `kda_step`) or a verify block (`kda_steps`) on these inputs."""
    if q.shape[1] == 1:
        one = [x[:, 0].contiguous() for x in (q, k, v, g, beta)]
        return lambda: kda_step(*one, state)
    return lambda: kda_steps(q, k, v, g, beta, state)


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernels.module() is None:
        raise SystemExit("the KDA CPU kernel did not build on this machine (see the warning above)")
    print(f"torch threads: {torch.get_num_threads()}")
    rows = []
    for label, b, t in (
        ("decode, batch 1", 1, 1),
        ("decode, batch 32", 32, 1),
        ("verify block 7, batch 1", 1, 7),
        ("verify block 7, batch 4", 4, 7),
    ):
        call = make_call(*inputs(b, t))
        times: dict[str, list[float]] = {"torch": [], "kernel": []}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for form, switch in (("torch", "0"), ("kernel", "1")):
                    os.environ[cpu_kernels.ENV_SWITCH] = switch
                    call()
                    times[form].append(per_call_us(call, args.calls))
        os.environ.pop(cpu_kernels.ENV_SWITCH)
        torch_us, kernel_us = statistics.median(times["torch"]), statistics.median(times["kernel"])
        rows.append(
            {
                "case": label,
                "torch_us": round(torch_us, 1),
                "kernel_us": round(kernel_us, 1),
                "ratio": round(torch_us / kernel_us, 2),
            }
        )
        print(f"{label:26s} torch {torch_us:8.1f} us   kernel {kernel_us:8.1f} us   {torch_us / kernel_us:5.2f}x")
    write_result(args.out, "kda_kernel", threads=args.threads, repeats=args.repeats, rows=rows)


if __name__ == "__main__":
    main()
