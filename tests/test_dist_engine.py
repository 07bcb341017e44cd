"""Distributed engine = single process: TP, EP and attention-DP layouts give the same greedy tokens and logprobs
(1e-4) on all three families, through chunked prefill, prefix-cache hits and preemption, every page and slot freed."""

from __future__ import annotations

import pytest
import torch
from dist_harness import spawn_ranks

from kestrel import LLM, SamplingParams
from kestrel.dist import dcp, pcp
from kestrel.dist.groups import ParallelLayout

FAMILIES = ["kimi_linear", "deepseek_v32", "kimi_k3"]
# A small pool (preemption), 7-token prefill chunks, 4-token pages, KDA checkpoints every 8 tokens (prefix hits).
ENGINE_ARGS = dict(max_total_tokens=192, page_size=4, chunked_prefill_size=7, state_track_interval=8)


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """16 prompts of different lengths (half share a 24-token prefix), then 4 that extend earlier ones."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 259, (24,), generator=gen).tolist()
    first = []
    for i, n in enumerate(torch.randint(3, 40, (16,), generator=gen).tolist()):
        tail = torch.randint(3, 259, (n,), generator=gen).tolist()
        first.append(shared + tail if i % 2 else tail)
    second = [p + torch.randint(3, 259, (5,), generator=gen).tolist() for p in first[1:9:2]]
    return first, second


def run_scenario(llm: LLM, seed: int = 0) -> dict:
    """Two waves of greedy requests; what must match across layouts, and what the pools hold afterwards."""
    first, second = _prompts(seed)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate(first, params, use_tqdm=False) + llm.generate(second, params, use_tqdm=False)
    engine = llm.engine
    latent = next(iter(engine.runner.kv.latent.values()), None)  # None: rank 0's pipeline stage has no MLA layer
    result = {
        "kv_rows_per_page": None if latent is None else latent.shape[0] // (engine.runner.scratch_page + 1),
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [o.outputs[0].logprobs for o in outs],
        "cached": sum(o.outputs[0].cached_tokens for o in outs[len(first) :]),
        "preemptions": engine.scheduler.num_preemptions,
        "idle_group_steps": getattr(engine.runner, "idle_group_steps", 0),
    }
    stats = engine.stats()
    engine.cache.check_counters()
    engine.cache.clear()
    result["idle"] = stats["pages_used"] == stats["slots_used"] == stats["running"] == stats["waiting"] == 0
    result["free"] = engine.pages.num_used == 0 and engine.slots.num_used == 0
    return result


def _rank(groups, paths: dict[str, str], engine_args: dict) -> dict | None:
    """Rank 0 runs the scenario on every family; the other ranks follow each engine in turn."""
    from kestrel.dist.engine_ranks import follow_engine
    from kestrel.dist.runner import release_followers
    from kestrel.engine.config import EngineConfig

    out = {}
    for family, path in paths.items():
        config = EngineConfig(model=path, **engine_args)
        if groups.rank:
            follow_engine(config, groups)
            continue
        try:
            dcp.TOTALS.clear()
            pcp.TOTALS.clear()
            out[family] = run_scenario(LLM(path, **engine_args))
            out[family]["dcp"], out[family]["pcp"] = dict(dcp.TOTALS), dict(pcp.TOTALS)
        finally:
            release_followers()
    return out if groups.rank == 0 else None


@pytest.fixture(scope="module")
def single_process(tiny_checkpoints):
    return {fam: run_scenario(LLM(str(tiny_checkpoints[fam]), **ENGINE_ARGS)) for fam in FAMILIES}


def _assert_same(got: dict, want: dict, dp_attn: int) -> None:
    assert got["tokens"] == want["tokens"]
    for a, b in zip(got["logprobs"], want["logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)
    assert want["cached"] > 0 and want["preemptions"] > 0  # prefix hits; a pool too small for everyone at once
    if dp_attn == 1:  # the same scheduling decisions
        assert got["cached"] == want["cached"] and got["preemptions"] == want["preemptions"]
    else:  # each group has a pool and prefix cache of its own; some steps left one group idle
        assert got["cached"] > 0 and got["preemptions"] > 0 and got["idle_group_steps"] > 0
    assert got["idle"] and got["free"]  # every group's pages and slots back on its free lists


@pytest.mark.parametrize(
    "layout, dispatch",
    [
        (ParallelLayout(tp=2), "allgather"),  # experts split inside (moe tp 2)
        (ParallelLayout(tp=4, ep=4), "alltoall"),
        (ParallelLayout(tp=2, ep=2, dp_attn=2), "allgather"),
        # Decode context parallelism (MLA/DSA KV sharded by token): 4 DSA candidates per rank < index_topk (16),
        # so the exact top-k merge falls back; interleaved pages; the all-gather / reduce-scatter merge.
        (ParallelLayout(tp=2, dcp=2, dcp_candidates=4), "allgather"),
        (ParallelLayout(tp=4, ep=2, dcp=4, dcp_merge="allgather"), "allgather"),
        (ParallelLayout(tp=4, dcp=2, dcp_interleave=2), "allgather"),
    ],
    ids=["tp2", "tp4-ep4-alltoall", "dp-attn2-tp2-ep2", "tp2-dcp2-c4", "tp4-ep2-dcp4-allgather", "tp4-dcp2-inter2"],
)
def test_parallel_engine_matches_single_process(layout, dispatch, tiny_checkpoints, single_process):
    paths = {fam: str(tiny_checkpoints[fam]) for fam in FAMILIES}
    args = ENGINE_ARGS | dict(tp=layout.tp, ep=layout.ep, dp_attn=layout.dp_attn, moe_dispatch=dispatch)
    args |= dict(dcp=layout.dcp, dcp_interleave=layout.dcp_interleave, dcp_topk_candidates=layout.dcp_candidates)
    args |= dict(dcp_merge=layout.dcp_merge)
    got = spawn_ranks(_rank, layout, paths, args)[0]
    for fam in FAMILIES:
        _assert_same(got[fam], single_process[fam], layout.dp_attn)
        # Under DCP each rank's pool keeps 1/dcp of every page, and every MLA/DSA decode ran sharded.
        assert got[fam]["kv_rows_per_page"] == ENGINE_ARGS["page_size"] // layout.dcp
        assert (got[fam]["dcp"].get("decode_layers", 0) > 0) == (layout.dcp > 1)
        if layout.dcp > 1 and fam != "kimi_linear":  # DSA: the exact top-k merge ran, and fell back when C < k
            assert got[fam]["dcp"]["merges"] > 0
            assert (got[fam]["dcp"]["fallback_pairs"] > 0) == (layout.dcp_candidates < 16)
