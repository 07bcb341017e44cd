"""Long-context decode: a stack of DSA layers (indexer + top-k sparse MLA) vs the same stack with dense MLA.

One process, one model (DeepSeek-V3.2 layers at K3.1's attention widths: kv_lora_rank 512, rope 64, index keys 128,
top-2048), random weights. For each context L the paged KV cache is filled directly with random latents / rope keys /
index keys at the scale the layers produce (unit RMS after their norms) instead of running a prefill, then one decode
token per sequence is timed through the whole stack: with the indexer switched off (dense MLA over all L tokens, same
weights) and with it (DSA), through the engine's `PagedCacheView`: DSA decode reads all L index keys but only the
k selected latents (`decode_index_keys` / `decode_kv_at`).

Reports median ms per decode step over --repeats (after --warmup steps) and the DSA/dense ratio per context, and
writes benchmarks/results/decode_long_context.json.

    .venv/bin/python benchmarks/decode_long_context.py --threads 1 --contexts 1024 4096 16384 65536
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from report import write_result

from kestrel.cache.kv_pool import KVStorage
from kestrel.config import model_config_from_dict
from kestrel.engine.model_runner import PagedCacheView
from kestrel.models.checkpoint import init_random_
from kestrel.models.decoder import CausalLM
from kestrel.models.forward_batch import ForwardBatch
from kestrel.models.loader import build_model
from kestrel.models.presets import preset_config

RESULTS = Path(__file__).resolve().parent / "results" / "decode_long_context.json"
PAGE_SIZE = 64
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def make_config(args: argparse.Namespace):
    raw = preset_config("deepseek_v32", "small") | {
        "vocab_size": 1024,
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "moe_intermediate_size": args.hidden // 2,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads,
        "q_lora_rank": args.hidden,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "index_n_heads": args.index_heads,
        "index_head_dim": 128,
        "index_topk": args.topk,
        "max_position_embeddings": 2 * max(args.contexts) + 2,
    }
    return model_config_from_dict(raw)


class DecodeSetup:
    """B sequences of L cached tokens in a paged cache, and the one-token decode batch that follows them."""

    def __init__(self, model: CausalLM, context: int, batch: int, seed: int) -> None:
        cfg, gen = model.cfg, torch.Generator().manual_seed(seed)
        pages_per_seq = -(-(context + 1) // PAGE_SIZE)
        self.kv = KVStorage(cfg, pages_per_seq * batch, PAGE_SIZE, torch.float32, "cpu")
        for layer in cfg.attention_layers:
            # Latents leave kv_a_layernorm and index keys leave the indexer's LayerNorm at unit RMS; rope keys are
            # scaled to match so neither score term dominates.
            for store in (self.kv.latent[layer], self.kv.rope_key[layer], self.kv.index_key[layer]):
                store.copy_(torch.randn(store.shape, generator=gen))
        # Shuffled pages: sequences do not own contiguous slot ranges, as in a running engine.
        pages = torch.randperm(pages_per_seq * batch, generator=gen).view(batch, pages_per_seq)
        offsets = torch.arange(PAGE_SIZE)
        self.history = [(p[:, None] * PAGE_SIZE + offsets).reshape(-1)[: context + 1] for p in pages]
        self.write = torch.stack([h[context] for h in self.history])
        self.ids = torch.randint(cfg.vocab_size, (batch,), generator=gen)
        self.context, self.batch = context, batch

    def forward_batch(self, view: type[PagedCacheView] = PagedCacheView) -> ForwardBatch:
        batch = ForwardBatch(
            input_ids=self.ids,
            positions=torch.full((self.batch,), self.context),
            extend_lens=[1] * self.batch,
            prefix_lens=[self.context] * self.batch,
        )
        lengths = [self.context + 1] * self.batch
        table, zeros = torch.stack(self.history), torch.zeros(self.batch, dtype=torch.long)
        batch.cache = view(self.kv, None, table, torch.tensor(lengths), lengths, self.batch, self.write, zeros, None)
        return batch


def time_decode(
    model: CausalLM, setup: DecodeSetup, view, warmup: int, repeats: int, clock
) -> tuple[list[float], torch.Tensor]:
    """Seconds per decode step (the step rewrites slot L each time, so every step sees the same L + 1 tokens), and
    the last step's hidden states."""
    times = []
    with torch.inference_mode():
        for step in range(warmup + repeats):
            batch = setup.forward_batch(view)
            t0 = clock()
            hidden = model(batch)
            if step >= warmup:
                times.append(clock() - t0)
    return times, hidden


def set_indexers(model: CausalLM, indexers: dict[int, torch.nn.Module | None]) -> None:
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.indexer = indexers[i]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536], help="cached tokens L")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (1: per-sequence path)")
    ap.add_argument("--layers", type=int, default=4, help="DSA decoder layers in the stack")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32, help="MLA heads (K3.1 Pro: 32)")
    ap.add_argument("--index-heads", type=int, default=64, help="indexer heads (K3.1 Pro / DeepSeek-V3.2: 64)")
    ap.add_argument("--topk", type=int, default=2048, help="index_topk")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--clock", default="wall", choices=list(CLOCKS), help="cpu: process CPU time (steadier on a shared machine)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as the engine does on CPU
    cfg = make_config(args)
    model = init_random_(build_model(cfg), seed=args.seed)
    indexers = {i: layer.self_attn.indexer for i, layer in enumerate(model.model.layers)}
    print(
        f"torch {torch.__version__} | threads {torch.get_num_threads()} | {platform.machine()} | fp32 | "
        f"{cfg.num_hidden_layers} DSA layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} MLA heads, "
        f"kv_lora_rank {cfg.kv_lora_rank}, rope {cfg.qk_rope_head_dim}, indexer {cfg.index_n_heads}x"
        f"{cfg.index_head_dim}, top-{cfg.index_topk} | batch {args.batch} | median of {args.repeats} "
        f"(+{args.warmup} warmup), {args.clock} clock"
    )

    rows = []
    for context in args.contexts:
        setup = DecodeSetup(model, context, args.batch, args.seed)
        set_indexers(model, dict.fromkeys(indexers))
        dense, _ = time_decode(model, setup, PagedCacheView, args.warmup, args.repeats, CLOCKS[args.clock])
        set_indexers(model, indexers)
        dsa, _ = time_decode(model, setup, PagedCacheView, args.warmup, args.repeats, CLOCKS[args.clock])
        t_dense, t_dsa = statistics.median(dense), statistics.median(dsa)
        row = {
            "context": context,
            "dense_ms_per_step": t_dense * 1e3,
            "dsa_ms_per_step": t_dsa * 1e3,
            "ratio": t_dsa / t_dense,
            "dense_times_s": dense,
            "dsa_times_s": dsa,
        }
        rows.append(row)
        print(
            f"  L={context}: dense {row['dense_ms_per_step']:.1f} ms, DSA {row['dsa_ms_per_step']:.1f} ms",
            flush=True,
        )
        del setup

    print(f"\n{'context':>8} | {'dense ms':>9} | {'DSA ms':>9} | {'DSA/dense':>9}")
    print("-" * 45)
    for r in rows:
        print(f"{r['context']:>8} | {r['dense_ms_per_step']:>9.2f} | {r['dsa_ms_per_step']:>9.2f} | {r['ratio']:>9.3f}")

    write_result(
        args.out,
        "decode_long_context",
        dtype="float32",
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
        clock=args.clock,
        warmup=args.warmup,
        repeats=args.repeats,
        results=rows,
    )


if __name__ == "__main__":
    main()
