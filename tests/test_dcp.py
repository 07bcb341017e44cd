"""Decode context parallelism: the merged DSA top-k equals the single-rank top-k exactly (random, heavy ties, one
rank owning every winner so the fallback must run, histories shorter than k, empty shards), and the log-sum-exp
merge of per-rank partial attention equals one-rank attention (1e-5) in both collective variants, over gloo at
world 2 and 4, with the bytes each moves."""

from __future__ import annotations

import pytest
import torch
from dist_harness import spawn_ranks

from kestrel.dist import comm, dcp
from kestrel.dist.groups import ParallelLayout


def _case(kind: str, world: int, seed: int) -> dict:
    """One top-k problem: full scores [B, L], history lengths [B], k, candidates c, interleave."""
    gen = torch.Generator().manual_seed(seed)
    b, length = 4, 64
    scores = torch.randn(b, length, generator=gen)
    lengths = torch.tensor([64, 41, 17, 5])
    k, c, inter = 12, 4, 1
    if kind == "ties":  # three distinct values: winners decided by position among equal scores
        scores = torch.randint(0, 3, (b, length), generator=gen).float()
        scores[1, ::3] = -0.0  # -0.0 ties with +0.0 like the floats do
        inter = 2
    elif kind == "skew":  # every winner on rank 0: its c-th candidate beats the others → fallback
        scores[:, (torch.arange(length) % world) == 0] += 100.0
        c = 8  # N·c ≥ k, so only rank 0 (whenever it holds more than c tokens) can hide a winner
    elif kind == "short":  # histories shorter than k (and than the world on some rows: empty shards)
        lengths = torch.tensor([7, 3, 1, 0])
    elif kind == "wide":  # c ≥ k: every rank's whole local top-k is a candidate
        c, inter = 16, 3
    return {"scores": scores, "lengths": lengths, "k": k, "c": c, "interleave": inter}


KINDS = ("random", "ties", "skew", "short", "wide")


def _rank_topk(groups, world: int) -> dict:
    """Every case on this rank's shard: merged positions and scores, and what moved."""
    out = {}
    group = groups.world
    for kind in KINDS:
        case = _case(kind, world, seed=len(kind))
        pos = dcp.shard_positions(case["scores"].shape[1], group.rank, world, case["interleave"])
        comm.reset_counters()
        scores, positions, stats = dcp.dcp_topk(
            case["scores"][:, pos], pos, case["lengths"], case["k"], case["c"], group, case["interleave"]
        )
        out[kind] = (scores, positions, stats, dict(comm.BYTES))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_topk_merge_equals_single_rank_topk(world):
    results = spawn_ranks(_rank_topk, ParallelLayout(tp=world), world)
    for kind in KINDS:
        case = _case(kind, world, seed=len(kind))
        ref_s, ref_p = dcp.reference_topk(case["scores"], case["lengths"], case["k"])
        sim_p, sim = dcp.simulate_topk(case["scores"], case["lengths"], case["k"], case["c"], world, case["interleave"])
        assert torch.equal(sim_p, ref_p), kind
        c = min(case["c"], case["k"])
        for rank, got in enumerate(results):
            scores, positions, stats, moved = got[kind]
            assert torch.equal(positions, ref_p), (kind, rank)
            assert torch.equal(scores, ref_s), (kind, rank)
            assert stats.candidate_bytes == moved["all_gather"] == 4 * c * 8  # B rows × c keys × 8 bytes
            assert stats.fallback_pairs == sim.fallback_pairs and stats.fallback_ranks == sim.fallback_ranks
            assert moved.get("broadcast", 0) == sim.fallback_bytes  # every rank takes part in each broadcast
        assert sum(got[kind][2].fallback_bytes for got in results) == sim.fallback_bytes
        if kind == "skew":
            assert sim.fallback_ranks == [0]  # rank 0 holds every winner: read on each row where it has more than c
            assert sim.fallback_pairs == int((dcp.shard_count(case["lengths"], 0, world) > c).sum()) > 0
        if kind == "wide":
            assert sim.fallback_pairs == 0  # c ≥ k: nothing more to read


def test_skewed_merge_is_wrong_without_the_fallback():
    """The fallback is load-bearing: the union of candidates alone misses rank 0's unsent winners."""
    world = 2
    case = _case("skew", world, seed=4)
    scores, lengths, k, c = case["scores"], case["lengths"], case["k"], case["c"]
    cands = []
    for r in range(world):
        pos = dcp.shard_positions(scores.shape[1], r, world)
        keys = dcp.pack_keys(scores[:, pos], pos.expand(scores.shape[0], -1), pos[None, :] < lengths[:, None])
        cands.append(dcp.top_keys(keys, c))
    merged = dcp.merge_candidates(torch.stack(cands), k)
    ref_p = dcp.reference_topk(scores, lengths, k)[1]
    assert not torch.equal(dcp.unpack_keys(merged)[1], ref_p)
    flags = dcp.fallback_mask(torch.stack(cands), merged[:, k - 1], lengths, c, k)
    assert torch.equal(flags[0], dcp.shard_count(lengths, 0, world) > c) and not flags[1].any()


def test_exact_topk_orders_by_score_then_lower_position():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        length = 1 + trial
        scores = torch.randint(-2, 3, (3, length), generator=gen).float() if trial % 2 else torch.randn(3, length)
        scores[0, ::2] = -0.0 if trial % 4 == 1 else scores[0, ::2]
        lengths = torch.randint(0, length + 1, (3,), generator=gen)
        k = 1 + trial % 9
        ref_s, ref_p = dcp.reference_topk(scores, lengths, k)
        got_s, got_p = dcp.exact_topk(scores, lengths, k)
        assert torch.equal(got_p, ref_p) and torch.equal(got_s, ref_s)
    s, p = dcp.exact_topk(torch.tensor([[1.0, 2.0, 2.0, -1.0, 2.0]]), torch.tensor([5]), 3)
    assert p.tolist() == [[1, 2, 4]] and s.tolist() == [[2.0, 2.0, 2.0]]
    s, p = dcp.exact_topk(torch.tensor([[float("-inf"), 0.5]]), torch.tensor([2]), 4)
    assert p.tolist() == [[1, 0, -1, -1]]


def test_shard_count_matches_shard_positions():
    for world in (1, 2, 3, 4):
        for inter in (1, 2, 5):
            for length in range(0, 40):
                counts = dcp.shard_count(torch.tensor([length]), 0, world, inter)
                for r in range(world):
                    expect = dcp.shard_positions(length, r, world, inter).numel()
                    assert int(dcp.shard_count(torch.tensor([length]), r, world, inter)) == expect
                assert int(counts) == dcp.shard_positions(length, 0, world, inter).numel()


def _attention_case(world: int) -> dict:
    """q [B, H, Dk] over keys / values [B, L, D]; lengths: full, ragged, one token (empty shards), none."""
    gen = torch.Generator().manual_seed(world)
    b, h, length, dk, dv = 5, 2 * world, 23, 8, 6
    return {
        "q": torch.randn(b, h, dk, generator=gen),
        "k": torch.randn(b, length, dk, generator=gen) * 2,
        "v": torch.randn(b, length, dv, generator=gen),
        "lengths": torch.tensor([23, 11, 1, 0, 2]),
        "scale": dk**-0.5,
    }


def _reference_attention(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank, whole history: softmax attention (rows with no keys: output 0, lse -inf)."""
    logits = torch.einsum("bhd,bld->bhl", case["q"], case["k"]) * case["scale"]
    allowed = torch.arange(logits.shape[-1])[None, :] < case["lengths"][:, None]
    logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
    out = torch.einsum("bhl,bld->bhd", torch.softmax(logits, dim=-1).nan_to_num(0.0), case["v"])
    return out, torch.logsumexp(logits, dim=-1)


def _rank_lse_merge(groups, world: int) -> dict:
    group = groups.world
    case = _attention_case(world)
    pos = dcp.shard_positions(case["k"].shape[1], group.rank, world)
    allowed = pos[None, :] < case["lengths"][:, None]
    out, lse = dcp.partial_attention(case["q"], case["k"][:, pos], case["v"][:, pos], allowed, case["scale"])
    got = {}
    for name, merge in (("allgather", dcp.merge_allgather), ("alltoall", dcp.merge_alltoall)):
        comm.reset_counters()
        got[name] = (*merge(out, lse, group), dict(comm.BYTES))
    return got


@pytest.mark.parametrize("world", [2, 4])
def test_lse_merge_of_sharded_attention_equals_one_rank_attention(world):
    results = spawn_ranks(_rank_lse_merge, ParallelLayout(tp=world), world)
    case = _attention_case(world)
    ref_out, ref_lse = _reference_attention(case)
    b, h, dv = ref_out.shape
    block = h // world
    for rank, got in enumerate(results):
        heads = slice(rank * block, (rank + 1) * block)
        for name, (out, lse, _moved) in got.items():
            assert out.shape == (b, block, dv), name
            torch.testing.assert_close(out, ref_out[:, heads], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, ref_lse[:, heads], atol=1e-5, rtol=1e-5)
            assert not out.isnan().any() and (out[3] == 0).all()  # the row with no history at all
        assert got["allgather"][2] == {"all_gather": b * h * 4, "reduce_scatter": b * h * dv * 4}
        assert got["alltoall"][2] == {"all_to_all": b * h * (dv + 1) * 4}


def test_merge_partials_handles_empty_shards_and_rows():
    """Simulated ranks: shards with no keys (lse -inf) drop out; a row empty everywhere gives 0, not NaN."""
    case = _attention_case(4)
    parts = []
    for r in range(4):
        pos = dcp.shard_positions(case["k"].shape[1], r, 4)
        allowed = pos[None, :] < case["lengths"][:, None]
        parts.append(dcp.partial_attention(case["q"], case["k"][:, pos], case["v"][:, pos], allowed, case["scale"]))
    assert (parts[3][1][2] == float("-inf")).all()  # rank 3 holds nothing of the one-token row
    out, lse = dcp.merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    ref_out, ref_lse = _reference_attention(case)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse)
    assert (out[3] == 0).all() and (lse[3] == float("-inf")).all()


def test_dcp_flags_parse_and_validate():
    from kestrel.cli import build_parser, engine_kwargs
    from kestrel.config import ConfigError
    from kestrel.engine.config import EngineConfig

    argv = ["generate", "--prompt", "x", "--tp", "4", "--dcp-size", "2", "--dcp-interleave", "2"]
    args = build_parser().parse_args(argv + ["--dcp-topk-candidates", "64", "--dcp-merge", "allgather"])
    layout = EngineConfig(**engine_kwargs(args)).parallel_layout()
    assert (layout.tp, layout.dcp, layout.dcp_interleave, layout.dcp_candidates) == (4, 2, 2, 64)
    assert layout.dcp_merge == "allgather"
    with pytest.raises(ConfigError, match="'dcp'"):
        EngineConfig(tp=3, dcp=2)
    with pytest.raises(ConfigError, match="'page_size'"):
        EngineConfig(tp=4, dcp=4, dcp_interleave=2, page_size=4)  # a page must split evenly over the ranks
    with pytest.raises(ConfigError, match="dp_attn"):
        ParallelLayout(tp=4, dp_attn=2, dcp=2).validate()


def test_single_rank_dsa_selection_breaks_ties_to_the_lower_position():
    """Prefill (topk_mask) and decode (topk_positions) pick the same set as the DCP order on exact ties: ReLU makes
    exact-zero index scores common, and torch.topk alone breaks ties arbitrarily."""
    from kestrel.models.layers.dsa import topk_mask
    from kestrel.models.layers.topk_order import topk_positions

    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]])
    causal = torch.ones_like(scores, dtype=torch.bool)
    assert topk_mask(scores, causal, 4).nonzero()[:, 1].tolist() == [0, 1, 2, 4]
    pos, sel = topk_positions(scores, causal, 4)
    assert pos.tolist() == [[4, 1, 0, 2]] and sel.all()
    short = torch.tensor([[True, True, False, False, False, False, False, False]])
    pos, sel = topk_positions(scores, short, 4)
    assert pos[sel].tolist() == [1, 0] and sel.tolist() == [[True, True, False, False]]
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        s = torch.randint(0, 3, (3, 40), generator=gen).float()  # heavy ties
        lengths = torch.randint(1, 41, (3,), generator=gen)
        allowed = torch.arange(40)[None, :] < lengths[:, None]
        pos, sel = topk_positions(s, allowed, 8)
        ref_p = dcp.reference_topk(s, lengths, 8)[1]
        assert torch.equal(pos.masked_fill(~sel, -1), ref_p)
