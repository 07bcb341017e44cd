"""KDA on CPU: the PyTorch forms vs the compiled token loop (`kestrel/models/layers/kda_kernel.py`), one run.

Shapes of kestrel-mini's KDA layers (4 heads, K = V = 64): an in-place decode step at batch 1 and 32, verify blocks of 7
tokens at batch 1 and 4 (PyTorch: the token loop of ATen ops), and prefills of 512 / 2,048 tokens (PyTorch: the
chunked WY form, `kda_chunked`), also at K = V = 128. Both forms alternate inside every repeat; the figure is the
median microseconds a call and the ratio torch / kernel.

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

from kestrel.models.layers import cpu_kernels, kda_kernel
from kestrel.models.layers.kda_ops import kda_chunked, kda_step, kda_steps

RESULTS = Path(__file__).resolve().parent / "results" / "kda_kernel.json"


def inputs(b: int, t: int, h: int = 4, d: int = 64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(b * 100 + t)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    q = F.normalize(rand(b, t, h, d), dim=-1) * d**-0.5
    k = F.normalize(rand(b, t, h, d), dim=-1)
    return q, k, rand(b, t, h, d), -F.softplus(rand(b, t, h, d)) * 0.2, torch.sigmoid(rand(b, t, h)), rand(b, h, d, d)


def make_call(q, k, v, g, beta, state):
    """A decode step (one token: `kda_step`), a verify block (`kda_steps`) or a prefill (`kda_chunked` without the
    kernel, the kernel's varlen loop with it) on these inputs."""
    if q.shape[1] > 64:

        def prefill():
            if not kda_kernel.applies(q, state):
                return kda_chunked(q, k, v, g, beta, initial_state=state)
            return kda_kernel.varlen(q[0], k[0], v[0], g[0], beta[0], state, [q.shape[1]], [0], [q.shape[1] - 1])

        return prefill
    if q.shape[1] == 1:
        one = [x[:, 0].contiguous() for x in (q, k, v, g, beta)]
        return lambda: kda_step(*one, state, in_place=True)  # the engine's decode step: states updated in the pool
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
    cases = [
        ("decode, batch 1", 1, 1, 64, 1),
        ("decode, batch 32", 32, 1, 64, 1),
        ("verify block 7, batch 1", 1, 7, 64, 1),
        ("verify block 7, batch 4", 4, 7, 64, 1),
        ("prefill 512 tokens", 1, 512, 64, 20),
        ("prefill 2048 tokens", 1, 2048, 64, 100),
        ("prefill 512 tokens, K = V = 128", 1, 512, 128, 40),
    ]
    for label, b, t, d, slower in cases:
        call, calls = make_call(*inputs(b, t, d=d)), max(3, args.calls // slower)
        times: dict[str, list[float]] = {"torch": [], "kernel": []}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for form, switch in (("torch", "0"), ("kernel", "1")):
                    os.environ[cpu_kernels.ENV_SWITCH] = switch
                    call()
                    times[form].append(per_call_us(call, calls))
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
        print(f"{label:32s} torch {torch_us:8.1f} us   kernel {kernel_us:8.1f} us   {torch_us / kernel_us:5.2f}x")
    write_result(args.out, "kda_kernel", threads=args.threads, repeats=args.repeats, rows=rows)


if __name__ == "__main__":
    main()
