"""Distributed engine = single process: TP, EP, attention-DP, DCP, PCP and PP layouts give the same greedy tokens and
logprobs (1e-4) on all three families, through chunked prefill, prefix-cache hits and preemption, every page and slot
freed."""

from __future__ import annotations

import pytest
import torch
from dist_harness import spawn_ranks

from kestrel import LLM, SamplingParams
from kestrel.dist import dcp, pcp, pp
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


def _rank(groups, paths: dict[str, str], engine_args: dict, scenario=run_scenario) -> dict | None:
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
            for totals in (dcp.TOTALS, pcp.TOTALS, pp.TOTALS):
                totals.clear()
            out[family] = scenario(LLM(path, **engine_args))
            out[family] |= {"dcp": dict(dcp.TOTALS), "pcp": dict(pcp.TOTALS), "pp": dict(pp.TOTALS)}
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


def _engine_args(layout: ParallelLayout, dispatch: str) -> dict:
    lay = dict(tp=layout.tp, ep=layout.ep, dp_attn=layout.dp_attn, pcp=layout.pcp, pp=layout.pp, moe_dispatch=dispatch)
    lay |= dict(dcp=layout.dcp, dcp_interleave=layout.dcp_interleave, dcp_topk_candidates=layout.dcp_candidates)
    lay |= dict(dcp_merge=layout.dcp_merge, pcp_split=layout.pcp_split, pcp_block=layout.pcp_block)
    if layout.pp_partition:
        lay["pp_partition"] = ",".join(map(str, layout.pp_partition))
    return ENGINE_ARGS | lay


@pytest.mark.parametrize(
    "layout, dispatch, families",
    [
        (ParallelLayout(tp=2), "allgather", FAMILIES),  # experts split inside (moe tp 2)
        (ParallelLayout(tp=4, ep=4), "alltoall", FAMILIES),
        (ParallelLayout(tp=2, ep=2, dp_attn=2), "allgather", FAMILIES),
        # Decode context parallelism (MLA/DSA KV sharded by token): 4 DSA candidates per rank < index_topk (16),
        # so the exact top-k merge falls back; interleaved pages; the all-gather / reduce-scatter merge. The second
        # wave's prompts extend the first wave's: prefix-cache hits read sharded pages (asserted in _assert_same).
        (ParallelLayout(tp=2, dcp=2, dcp_candidates=4), "allgather", FAMILIES),
        (ParallelLayout(tp=4, ep=2, dcp=4, dcp_merge="allgather"), "allgather", FAMILIES),
        (ParallelLayout(tp=4, dcp=2, dcp_interleave=2), "allgather", FAMILIES),
        # Prefill context parallelism: every 7-token chunk split in 3-token round-robin blocks (and cut at KDA
        # checkpoints). Pipeline stages of 3 + 1 layers (kimi_k3: an AttnRes bank crosses), chunks cut over 2
        # micro-batches. PP x PCP: test_prefill_context_and_pipeline_parallel_long_prompts_match_single_process.
        (ParallelLayout(pcp=2, pcp_split="roundrobin", pcp_block=3), "allgather", FAMILIES),
        (ParallelLayout(pp=2, pp_partition=(3, 1)), "allgather", FAMILIES),
    ],
    ids=[
        "tp2",
        "tp4-ep4-alltoall",
        "dp-attn2-tp2-ep2",
        "tp2-dcp2-c4",
        "tp4-ep2-dcp4-allgather",
        "tp4-dcp2-inter2",
        "pcp2-roundrobin",
        "pp2-partition-3-1",
    ],
)
def test_parallel_engine_matches_single_process(layout, dispatch, families, tiny_checkpoints, single_process):
    paths = {fam: str(tiny_checkpoints[fam]) for fam in families}
    got = spawn_ranks(_rank, layout, paths, _engine_args(layout, dispatch))[0]
    for fam in families:
        _assert_same(got[fam], single_process[fam], layout.dp_attn)
        # Under DCP each rank's pool keeps 1/dcp of every page, and every MLA/DSA decode ran sharded.
        if got[fam]["kv_rows_per_page"] is not None:  # None: rank 0's pipeline stage holds no MLA layer
            assert got[fam]["kv_rows_per_page"] == ENGINE_ARGS["page_size"] // layout.dcp
        assert (got[fam]["dcp"].get("decode_layers", 0) > 0) == (layout.dcp > 1)
        if layout.dcp > 1 and fam != "kimi_linear":  # DSA: the exact top-k merge ran, and fell back when C < k
            assert got[fam]["dcp"]["merges"] > 0
            assert (got[fam]["dcp"]["fallback_pairs"] > 0) == (layout.dcp_candidates < 16)
        # PCP: prefills were split, and the KDA layers composed segment maps across ranks.
        assert (got[fam]["pcp"].get("segments", 0) > got[fam]["pcp"].get("prefills", 0)) == (layout.pcp > 1)
        assert (got[fam]["pcp"].get("kda_layers", 0) > 0) == (layout.pcp > 1 and fam != "deepseek_v32")
        # PP: steps ran as 2 micro-batches, some prefill chunks cut between them.
        if layout.pp > 1:
            assert got[fam]["pp"]["micro_batches"] > got[fam]["pp"]["steps"] and got[fam]["pp"]["cut_chunks"] > 0


# Long prompts (36-55 pages of 4), each prefilled whole: zigzag segments of ~50-100 tokens span several 64-token KDA
# chunks, and the 128-token checkpoints cut them; the second wave hits those checkpoints.
LONG_ARGS = dict(max_total_tokens=2048, page_size=4, chunked_prefill_size=-1, state_track_interval=128)


def long_scenario(llm: LLM) -> dict:
    gen = torch.Generator().manual_seed(5)
    first = [torch.randint(3, 259, (n,), generator=gen).tolist() for n in (144, 170, 201, 220)]
    second = [p + torch.randint(3, 259, (9,), generator=gen).tolist() for p in first[1:3]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    with_prompt = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate(first[:3], params, use_tqdm=False) + llm.generate(first[3:], with_prompt, use_tqdm=False)
    outs += llm.generate(second, params, use_tqdm=False)
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [o.outputs[0].logprobs for o in outs],
        "prompt_logprobs": [lp for lp in outs[3].prompt_logprobs if lp is not None],
        "cached": [o.outputs[0].cached_tokens for o in outs[len(first) :]],
    }


def test_prefill_context_and_pipeline_parallel_long_prompts_match_single_process(tiny_checkpoints):
    """PCP 2 inside each of 2 pipeline stages, zigzag split; one request asks for prompt logprobs (its every row
    gathered from the rank that computed it, then sent from the last stage)."""
    paths = {fam: str(tiny_checkpoints[fam]) for fam in ("kimi_k3",)}
    want = {fam: long_scenario(LLM(path, **LONG_ARGS)) for fam, path in paths.items()}
    layout = ParallelLayout(pcp=2, pp=2)
    got = spawn_ranks(_rank, layout, paths, LONG_ARGS | dict(pcp=2, pp=2), long_scenario)[0]
    for fam in paths:
        assert got[fam]["tokens"] == want[fam]["tokens"]
        for a, b in zip(got[fam]["logprobs"], want[fam]["logprobs"]):
            assert a == pytest.approx(b, abs=1e-4)
        got_prompt, want_prompt = got[fam]["prompt_logprobs"], want[fam]["prompt_logprobs"]
        assert len(want_prompt) == 219 and [x.token_id for x in got_prompt] == [x.token_id for x in want_prompt]
        assert [x.logprob for x in got_prompt] == pytest.approx([x.logprob for x in want_prompt], abs=1e-4)
        assert got[fam]["cached"] == want[fam]["cached"] and min(want[fam]["cached"]) >= 128  # prefix-cache hits
        assert got[fam]["pcp"]["longest_segment"] > 64 and got[fam]["pcp"]["kda_layers"] > 0
