"""Each parallel layer equals its unsharded twin at world 1, 2 and 4 (uneven vocabularies and expert maps,
padding rows routed to no expert, both MoE dispatch schemes), loading its shard through `checkpoint_slice`; whole
sharded models of the three families give the one-process logits (1e-4)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import spawn_ranks
from torch import nn

from kestrel.config import ConfigError
from kestrel.dist import comm
from kestrel.dist.groups import ParallelLayout
from kestrel.models.weight_loaders import SKIP, loader_of, slice_of


def _fill(param: torch.Tensor, full: torch.Tensor, shard="full") -> bool:
    """Load `full` (a checkpoint tensor) into a sharded parameter the way the checkpoint loader does."""
    index = slice_of(param, shard, tuple(full.shape))
    if index == SKIP:
        return False
    fn, _ = loader_of(param)
    fn(param, full if index is None else full[index], shard)
    return True


def _twins(seed: int):
    from kestrel.config import model_config_from_dict
    from kestrel.models.layers.linear import FusedLinear
    from kestrel.models.layers.moe import Experts
    from kestrel.models.presets import preset_config

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = model_config_from_dict(preset_config("kimi_k3", "tiny"))
    experts = Experts(cfg, 16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * 0.3)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * 0.3)
    return {
        "linear": nn.Linear(12, 8, bias=True),
        "fused": FusedLinear(12, {"a": 8, "b": 4, "c": 16}, frozenset({"b"})),
        "embed": nn.Embedding(10, 6),  # 10 rows: uneven over 4 ranks
        "head": nn.Linear(6, 10, bias=False),
        "experts": experts,
        "x": torch.randn(5, 12, generator=gen),
        "xe": torch.randn(5, 16, generator=gen),
        "ids": torch.tensor([[0, 3], [7, 1], [-1, -1], [2, 7], [5, -1]]),  # -1: padding, routed to no expert
        "weights": torch.rand(5, 2, generator=gen),
        "tokens": torch.tensor([[0, 9, 3], [5, 5, 1]]),
    }


def _model_logits(groups, paths: dict[str, str]) -> dict[str, torch.Tensor]:
    """Each family's sharded model on one 40-token prompt (no cache): full logits, gathered."""
    from kestrel.dist.tensor_parallel import load_sharded_model
    from kestrel.models.forward_batch import ForwardBatch

    out = {}
    for family, path in paths.items():
        model, _ = load_sharded_model(path, groups)
        with torch.inference_mode():
            out[family] = model.logits(model(ForwardBatch.single(torch.arange(3, 43))))
    return out


def _layers_rank(groups, seed: int, owners: list[int], paths: dict[str, str]) -> dict[str, float]:
    from kestrel.dist.moe import ParallelExperts
    from kestrel.dist.parallel import (
        ColumnParallelLinear,
        ParallelFusedLinear,
        ParallelLMHead,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from kestrel.models.layers.moe import expert_segments

    t = _twins(seed)
    g, x, errs = groups.world, t["x"], {}
    with torch.no_grad():
        col = ColumnParallelLinear(t["linear"], g, gather=True)
        _fill(col.weight, t["linear"].weight), _fill(col.bias, t["linear"].bias)
        errs["column"] = (col(x) - t["linear"](x)).abs().max().item()
        row = RowParallelLinear(nn.Linear(8, 12, bias=True), g)
        twin = nn.Linear(8, 12, bias=True)
        _fill(row.weight, twin.weight), _fill(row.bias, twin.bias)
        h = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
        local = h.chunk(g.size, dim=1)[g.rank]
        errs["row"] = (row(local) - twin(h)).abs().max().item()
        fused = ParallelFusedLinear(t["fused"], g, {"a", "c"})
        for name, part in zip(t["fused"].parts, t["fused"].weight.split(t["fused"].sizes)):
            _fill(fused.weight, part, name)
        _fill(fused.bias, t["fused"].bias[8:12], "b")
        want = t["fused"](x)
        got = fused(x)
        errs["fused_split"] = max((got[i] - want[i].chunk(g.size, dim=-1)[g.rank]).abs().max().item() for i in (0, 2))
        errs["fused_replicated"] = (got[1] - want[1]).abs().max().item()
        emb = VocabParallelEmbedding(t["embed"], g)
        _fill(emb.weight, t["embed"].weight)
        errs["embedding"] = (emb(t["tokens"]) - t["embed"](t["tokens"])).abs().max().item()
        head = ParallelLMHead(t["head"], g)
        _fill(head.weight, t["head"].weight)
        y = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed + 1))
        errs["lm_head"] = (head(y) - t["head"](y)).abs().max().item() if head(y).shape == (3, 10) else 1.0
        ex, ids, w, xe = t["experts"], t["ids"], t["weights"], t["xe"]
        pad = ids < 0  # the twin: padding pairs weigh nothing
        act = (ex.act.kind, ex.act.beta or 0.0, ex.act.linear_beta or 0.0)  # K3: SiTU
        want = expert_segments(xe, ids.clamp_min(0), w.masked_fill(pad, 0), ex.gate_up_proj, ex.down_proj, *act)
        for dispatch in ("allgather", "alltoall"):
            if dispatch == "alltoall" and groups.moe_tp.size > 1:
                continue
            par = ParallelExperts(ex, owners, groups.moe_ep, groups.moe_tp, g, dispatch)
            inter = ex.gate_up_proj.shape[1] // 2
            for e in range(ex.gate_up_proj.shape[0]):
                _fill(par.gate_up_proj, ex.gate_up_proj[e, :inter], (e, 0))
                _fill(par.gate_up_proj, ex.gate_up_proj[e, inter:], (e, 1))
                _fill(par.down_proj, ex.down_proj[e], (e, None))
            errs[f"experts_{dispatch}"] = (par(xe, ids, w) - want).abs().max().item()
            errs["local_experts"] = len(par.local_experts)
        comm.reset_counters()
        row(local)
        errs["all_reduce_bytes"] = comm.BYTES["all_reduce"]
        # The other wrappers: each rank contributes (rank + 1) · [1, 2, ..., 2n] (n the group size).
        n = g.size
        mine = (g.rank + 1) * torch.arange(1.0, 2 * n + 1)
        total = n * (n + 1) / 2 * torch.arange(1.0, 2 * n + 1)
        errs["reduce_scatter"] = (comm.reduce_scatter(mine.clone(), g) - total.view(n, 2)[g.rank]).abs().max().item()
        to_each = torch.arange(n, dtype=torch.float32) + 10 * g.rank  # row j goes to rank j
        got = comm.all_to_all(to_each[:, None], [1] * n, [1] * n, g)[:, 0]  # row i came from rank i
        errs["all_to_all"] = (got - (g.rank + 10 * torch.arange(n))).abs().max().item()
        sent = comm.broadcast_cpu(torch.full((3,), float(g.rank)), g)
        errs["broadcast"] = sent.abs().max().item()  # rank 0's zeros everywhere
    errs["logits"] = _model_logits(groups, paths)
    return errs


UNEVEN = [0, 0, 0, 0, 0, 1, 1, 1]  # rank 0 holds five experts, rank 1 three


@pytest.mark.parametrize(
    "layout, owners",
    [
        (ParallelLayout(tp=1), [0] * 8),
        (ParallelLayout(tp=2, ep=2, expert_map=tuple(UNEVEN)), UNEVEN),
        (ParallelLayout(tp=4, ep=2), [e // 4 for e in range(8)]),  # experts also split 2-way inside (moe tp 2)
    ],
    ids=["world1", "world2-uneven-ep2", "world4-ep2"],
)
def test_parallel_layers_and_models_equal_unsharded_twins(layout, owners, tiny_checkpoints):
    from kestrel.models.forward_batch import ForwardBatch
    from kestrel.models.loader import load_model

    paths = {fam: str(p) for fam, p in tiny_checkpoints.items()}
    want = {}
    for family, path in paths.items():
        model, _ = load_model(path)
        with torch.inference_mode():
            want[family] = model.logits(model(ForwardBatch.single(torch.arange(3, 43))))
    for rank, errs in enumerate(spawn_ranks(_layers_rank, layout, 0, owners, paths)):
        assert errs.pop("local_experts") == owners.count(rank // layout.moe_tp)
        assert "experts_alltoall" in errs or layout.moe_tp > 1
        # The comm layer counts what a row-parallel layer reduces: [5, 12] fp32 = 240 bytes, nothing alone.
        assert errs.pop("all_reduce_bytes") == (240 if layout.world > 1 else 0)
        for family, logits in errs.pop("logits").items():  # whole sharded models: tiny checkpoints, 3 families
            assert torch.equal(logits.argmax(-1), want[family].argmax(-1))
            assert (logits - want[family]).abs().max() < 1e-4, family
        for name, err in errs.items():
            assert err < 1e-5, (rank, name, err)


def test_layout_rules_fail_with_one_clear_error():
    from kestrel.config import model_config_from_dict
    from kestrel.models.presets import preset_config

    cfg = model_config_from_dict(preset_config("kimi_k3", "tiny"))  # 4 heads, 8 experts
    with pytest.raises(ConfigError, match="tp % dp_attn == 0"):
        ParallelLayout(tp=4, dp_attn=3).validate(cfg)
    with pytest.raises(ConfigError, match=r"--ep: num_experts \(8\) % ep == 0"):
        ParallelLayout(tp=6, ep=3, dp_attn=3).validate(cfg)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) % attention tp \(8\)"):
        ParallelLayout(tp=8).validate(cfg)
    with pytest.raises(ConfigError, match="--ep-expert-map: every EP rank needs an expert"):
        ParallelLayout(tp=2, ep=2, expert_map=(0,) * 8).validate(cfg)
    ParallelLayout(tp=2, ep=2, expert_map=tuple(UNEVEN)).validate(cfg)
    # Pipeline and prefill context parallelism: the partition, the stage count, and what they do not combine with.
    with pytest.raises(ConfigError, match=r"--pp-partition .*: 3 entries \[1, 1, 2\], needs one per stage \(--pp 2\)"):
        ParallelLayout(pp=2, pp_partition=(1, 1, 2)).validate()
    with pytest.raises(ConfigError, match=r"--pp-partition .*: \[3, 3\] sums to 6, the model has 4 layers"):
        ParallelLayout(pp=2, pp_partition=(3, 3)).validate(cfg)
    with pytest.raises(ConfigError, match=r"--pp-partition .*: every stage needs at least one layer"):
        ParallelLayout(pp=2, pp_partition=(4, 0)).validate(cfg)
    with pytest.raises(ConfigError, match=r"--pp: 5 stages for 4 layers"):
        ParallelLayout(pp=5).validate(cfg)
    with pytest.raises(ConfigError, match=r"--pcp: pcp > 1 with dcp > 1 is not supported yet"):
        ParallelLayout(tp=2, dcp=2, pcp=2).validate(cfg)
    with pytest.raises(ConfigError, match=r"--pcp-split: zigzag or roundrobin"):
        ParallelLayout(pcp=2, pcp_split="ring").validate(cfg)
    ParallelLayout(tp=2, pcp=2, pp=2, pp_partition=(1, 3)).validate(cfg)
