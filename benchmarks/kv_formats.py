"""Decode step time and bytes read per KV format (`--kv-cache-dtype auto|fp8_e4m3|nvfp4`) at long context.

One process, one model: a stack of DSA layers at K3.1's attention widths (kv_lora_rank 512, rope 64, index keys 128,
top-2048; DeepSeek-V3.2 layers, random weights), as in `decode_long_context.py`. For each context L and format the
paged pool is filled directly (random latents / rope keys / index keys at unit RMS, quantized on write exactly as
the engine stores them), then one decode token per sequence is timed through the whole stack via the engine's
`PagedCacheView`: DSA decode reads all L index keys and only the k selected latent rows, dequantizing what it reads.

Bytes read per step (per sequence, all layers) = L · index-key bytes + min(L, k) · latent-row bytes, from the pool's
real row widths. The baseline is `auto` (the fp32 model dtype here; bf16 is half of it). Reports median ms per step
and the ratio to auto per context, and writes benchmarks/results/kv_formats.json.

    .venv/bin/python benchmarks/kv_formats.py --threads 1 --contexts 4096 16384
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from decode_long_context import make_config  # the same DSA stack at K3.1 widths
from report import write_result

from kestrel.cache.kv_pool import make_kv_storage
from kestrel.engine.model_runner import PagedCacheView, latent_bounds
from kestrel.models.checkpoint import init_random_
from kestrel.models.decoder import CausalLM
from kestrel.models.forward_batch import ForwardBatch
from kestrel.models.loader import build_model
from kestrel.quant.kv_formats import KV_CACHE_DTYPES

RESULTS = Path(__file__).resolve().parent / "results" / "kv_formats.json"
PAGE_SIZE = 64
FILL_CHUNK = 4096


class Setup:
    """B sequences of L cached tokens in a pool of one format, and the decode batch that follows them."""

    def __init__(self, model: CausalLM, fmt: str, context: int, batch: int, seed: int) -> None:
        cfg, gen = model.cfg, torch.Generator().manual_seed(seed)
        pages_per_seq = -(-(context + 1) // PAGE_SIZE)
        n_slots = pages_per_seq * batch * PAGE_SIZE
        self.kv = make_kv_storage(
            cfg, pages_per_seq * batch, PAGE_SIZE, torch.float32, "cpu", fmt, latent_bounds(model)
        )
        for layer in cfg.attention_layers:
            for lo in range(0, n_slots, FILL_CHUNK):  # same random values for every format (same seed)
                n = min(FILL_CHUNK, n_slots - lo)
                latent = torch.randn(n, cfg.kv_lora_rank, generator=gen)
                rope = torch.randn(n, cfg.qk_rope_head_dim, generator=gen)
                index = torch.randn(n, cfg.index_head_dim, generator=gen)
                self.kv.write(layer, torch.arange(lo, lo + n), latent, rope, index)
        pages = torch.randperm(pages_per_seq * batch, generator=gen).view(batch, pages_per_seq)
        offsets = torch.arange(PAGE_SIZE)
        self.history = [(p[:, None] * PAGE_SIZE + offsets).reshape(-1)[: context + 1] for p in pages]
        self.write = torch.stack([h[context] for h in self.history])
        self.ids = torch.randint(cfg.vocab_size, (batch,), generator=gen)
        self.context, self.batch = context, batch

    def forward_batch(self) -> ForwardBatch:
        batch = ForwardBatch(
            input_ids=self.ids,
            positions=torch.full((self.batch,), self.context),
            extend_lens=[1] * self.batch,
            prefix_lens=[self.context] * self.batch,
        )
        lengths = [self.context + 1] * self.batch
        table, zeros = torch.stack(self.history), torch.zeros(self.batch, dtype=torch.long)
        batch.cache = PagedCacheView(
            self.kv, None, table, torch.tensor(lengths), lengths, self.batch, self.write, zeros
        )
        return batch


def bytes_read_per_step(kv, cfg, context: int) -> int:
    """Pool bytes one sequence's decode step reads over all layers: every index key, the top-k latent rows."""
    total = 0
    for layer in cfg.attention_layers:
        latent_row = kv.latent[layer].shape[1] * kv.latent[layer].element_size()
        if getattr(kv, "rope_key", None) is not None and layer in kv.rope_key:
            latent_row += kv.rope_key[layer].shape[1] * kv.rope_key[layer].element_size()
        index_row = kv.index_key[layer].shape[1] * kv.index_key[layer].element_size()
        total += (context + 1) * index_row + min(context + 1, cfg.index_topk) * latent_row
    return total


def time_decode(model: CausalLM, setup: Setup, warmup: int, repeats: int) -> tuple[list[float], torch.Tensor]:
    times = []
    with torch.inference_mode():
        for step in range(warmup + repeats):
            batch = setup.forward_batch()
            t0 = time.perf_counter()
            hidden = model(batch)
            if step >= warmup:
                times.append(time.perf_counter() - t0)
    return times, hidden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384], help="cached tokens L")
    ap.add_argument("--formats", nargs="+", default=list(KV_CACHE_DTYPES), choices=KV_CACHE_DTYPES)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--layers", type=int, default=4, help="DSA decoder layers in the stack")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32, help="MLA heads (K3.1 Pro: 32)")
    ap.add_argument("--index-heads", type=int, default=64, help="indexer heads (K3.1 Pro / DeepSeek-V3.2: 64)")
    ap.add_argument("--topk", type=int, default=2048, help="index_topk")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as the engine does on CPU
    cfg = make_config(args)
    model = init_random_(build_model(cfg), seed=args.seed)
    print(
        f"torch {torch.__version__} | threads {torch.get_num_threads()} | {platform.machine()} | fp32 compute | "
        f"{cfg.num_hidden_layers} DSA layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} MLA heads, "
        f"kv_lora_rank {cfg.kv_lora_rank}, rope {cfg.qk_rope_head_dim}, indexer {cfg.index_n_heads}x"
        f"{cfg.index_head_dim}, top-{cfg.index_topk} | batch {args.batch} | median of {args.repeats} "
        f"(+{args.warmup} warmup)"
    )
    rows = []
    for context in args.contexts:
        base = None
        for fmt in args.formats:
            setup = Setup(model, fmt, context, args.batch, args.seed)
            times, _ = time_decode(model, setup, args.warmup, args.repeats)
            ms = statistics.median(times) * 1e3
            base = ms if fmt == "auto" or base is None else base
            read = bytes_read_per_step(setup.kv, cfg, context) * args.batch
            row = {
                "context": context,
                "format": fmt,
                "ms_per_step": ms,
                "ratio_to_first": ms / base,
                "bytes_read_per_step": read,
                "pool_bytes_per_token": setup.kv.packed_bytes_per_token,
                "times_s": times,
            }
            rows.append(row)
            print(f"  L={context} {fmt:>9}: {ms:8.2f} ms, {read / 2**20:8.2f} MiB read per step", flush=True)
            del setup

    print(f"\n{'context':>8} | {'format':>9} | {'ms/step':>8} | {'x first':>7} | {'MiB read':>8} | {'B/token':>7}")
    print("-" * 62)
    for r in rows:
        print(
            f"{r['context']:>8} | {r['format']:>9} | {r['ms_per_step']:>8.2f} | {r['ratio_to_first']:>7.3f} | "
            f"{r['bytes_read_per_step'] / 2**20:>8.2f} | {r['pool_bytes_per_token']:>7}"
        )
    write_result(
        args.out,
        "kv_formats",
        compute_dtype="float32",
        batch=args.batch,
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        heads=cfg.num_attention_heads,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        index_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        page_size=PAGE_SIZE,
        warmup=args.warmup,
        repeats=args.repeats,
        results=rows,
    )


if __name__ == "__main__":
    main()
