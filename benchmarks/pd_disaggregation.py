"""1P1D (prefill worker + decode worker behind sglang-router in PD mode, KV over Mooncake TCP on loopback) against
one unified `kestrel serve` on the same AgentX-style workload (`kestrel bench serve`).

Per concurrency: TTFT and inter-token latency P50/P90 and output tokens/s for both, with ratios (1P1D / unified).
From the workers' /metrics: bytes moved, transfers, time per transfer and MB/s (prefill side: the writes; decode
side: from registering the room to the bytes' arrival, which includes the prefill's compute). On a small CPU the
point is correctness and the ITL spread (decode steps never wait for a prompt's prefill), not speed: the unified
worker gets as many threads as the two PD workers together.

    .venv/bin/python benchmarks/pd_disaggregation.py --threads 1 --concurrency 1,2,4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from report import write_result

from kestrel.bench.agentx import BenchConfig, Workload, run_bench

RESULTS = Path(__file__).resolve().parent / "results" / "pd_disaggregation.json"
FLAGS = ["--device", "cpu", "--max-total-tokens", "32768", "--max-model-len", "4096", "--max-running-requests", "16"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(cmd: list[str], health: str, log: Path):
    """Run until the block ends (one SIGINT, then a kill after 30 s); up once `health` answers 200."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(health, timeout=5).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[:5]} did not come up; see {log}")
            time.sleep(0.2)
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def serve(port: int, threads: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kestrel.cli",
        "serve",
        "--port",
        str(port),
        "--num-threads",
        str(threads),
        *FLAGS,
        *extra,
    ]


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kestrel_disagg_") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def transfer_summary(m: dict[str, float]) -> dict[str, float | None]:
    n = m.get("kestrel_disagg_transfer_latency_seconds_count", 0)
    seconds = m.get("kestrel_disagg_transfer_latency_seconds_sum", 0.0)
    nbytes = m.get("kestrel_disagg_transfer_bytes_total", 0.0)
    return {
        "transfers": n,
        "failed": m.get("kestrel_disagg_failed_transfers_total", 0.0),
        "mb": nbytes / 1e6,
        "mb_per_transfer": nbytes / n / 1e6 if n else None,
        "ms_per_transfer": 1e3 * seconds / n if n else None,
        "mb_per_s": nbytes / seconds / 1e6 if seconds else None,
    }


def bench(url: str, args, workload: Workload) -> list[dict]:
    cfg = BenchConfig(base_url=url, concurrency=args.concurrency, seed=args.seed, workload=workload)
    return run_bench(cfg)["levels"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each PD worker (unified: twice that)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--output-tokens-median", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", type=Path, default=Path("out/pd-bench"))
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # this process only drives HTTP; recorded with the figures
    args.logs.mkdir(parents=True, exist_ok=True)
    workload = Workload(
        turns=args.turns,
        system_tokens=args.system_tokens,
        tool_tokens_min=50,
        tool_tokens_max=400,
        output_tokens_median=args.output_tokens_median,
        min_output_tokens=16,
        max_output_tokens=128,
    )
    u, p, d, boot, r = (free_port() for _ in range(5))
    url = "http://127.0.0.1:{}".format
    with process(serve(u, 2 * args.threads), url(u) + "/health", args.logs / "unified.log"):
        unified = bench(url(u), args, workload)
    prefill = serve(p, args.threads, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot))
    router = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(r)]
    router += ["--pd-disaggregation", "--prefill", url(p), str(boot), "--decode", url(d)]
    router += ["--prometheus-port", str(free_port())]
    with (
        process(prefill, url(p) + "/health", args.logs / "prefill.log"),
        process(
            serve(d, args.threads, "--disaggregation-mode", "decode"), url(d) + "/health", args.logs / "decode.log"
        ),
        process(router, url(r) + "/health", args.logs / "router.log"),
    ):
        pd = bench(url(r), args, workload)
        sent, received = transfer_summary(metrics(url(p))), transfer_summary(metrics(url(d)))

    print(
        f"\nkestrel-mini, PD workers {args.threads} thread(s) each, unified {2 * args.threads}; "
        f"{args.turns} turns, system {args.system_tokens} tokens, output median {args.output_tokens_median}"
    )
    head = (
        f"{'c':>3} {'setup':<9} {'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} {'ITL p90':>8} {'tok/s':>7} {'err':>4}"
    )
    print(head)
    rows = []
    for a, b in zip(unified, pd, strict=True):
        for name, lv in (("unified", a), ("1P1D", b)):
            print(
                f"{lv['concurrency']:>3} {name:<9} {lv['ttft_p50_s']:>9.3f} {lv['ttft_p90_s']:>9.3f} "
                f"{1e3 * lv['itl_p50_s']:>6.1f}ms {1e3 * lv['itl_p90_s']:>6.1f}ms {lv['throughput_tok_s']:>7.1f} "
                f"{lv['errors']:>4}"
            )
        ratio = {k: b[k] / a[k] for k in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "throughput_tok_s")}
        print(f"{'':>3} {'ratio':<9} " + " ".join(f"{v:>8.2f}x" for v in ratio.values()))
        rows.append({"concurrency": a["concurrency"], "unified": a, "pd_1p1d": b, "ratio_pd_over_unified": ratio})
    print("\ntransfers        count  failed   MB total  MB/transfer  ms/transfer     MB/s")
    for name, t in (("prefill (write)", sent), ("decode (wait)", received)):
        print(
            f"{name:<16} {t['transfers']:>5.0f} {t['failed']:>7.0f} {t['mb']:>10.2f} "
            f"{t['mb_per_transfer'] or 0:>12.3f} {t['ms_per_transfer'] or 0:>12.2f} {t['mb_per_s'] or 0:>8.1f}"
        )
    write_result(
        args.out,
        "pd_disaggregation",
        pd_worker_threads=args.threads,
        unified_threads=2 * args.threads,
        workload=vars(workload),
        levels=rows,
        transfer_prefill=sent,
        transfer_decode=received,
    )


if __name__ == "__main__":
    main()
