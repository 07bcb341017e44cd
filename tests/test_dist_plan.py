"""`kestrel plan` and the engine agree per rank: weight bytes, KV bytes per token and KDA state bytes per request
that the planner prints for a layout (per pipeline stage) are what each rank of that layout allocates (small presets,
bf16)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import spawn_ranks

from kestrel.config import load_model_config
from kestrel.dist import memory
from kestrel.dist.groups import ParallelLayout
from kestrel.models.loader import build_model
from kestrel.plan import Layout, plan

FAMILIES = ("kimi_linear", "kimi_k3")


def _allocated(groups, paths: dict[str, str]) -> dict[str, dict[str, int]]:
    """Per family: this rank's shard and pools as the engine's runner sizes them (one page, one slot)."""
    from kestrel.cache.kv_pool import KVStorage
    from kestrel.cache.state_pool import StateStorage
    from kestrel.dist.tensor_parallel import load_sharded_model

    out = {}
    for family, path in paths.items():
        model, _ = load_sharded_model(path, groups, torch.bfloat16)
        cfg = model.cfg  # the rank's view: what ModelRunner sizes its pools from
        states = StateStorage(cfg, 1, model.dtype, "cpu") if cfg.kda_layers else None
        out[family] = {
            "weights": memory.weight_bytes(model),
            "fp32_params": memory.fp32_params(model),
            "kv_per_token": memory.kv_bytes_per_token(KVStorage(cfg, 1, 1, model.dtype, "cpu")),
            "state_per_request": memory.state_bytes_per_slot(states),
            "stage": groups.stage,
            "dsa_layers": sum(cfg.layer_kinds[i] == "dsa" for i in cfg.attention_layers),  # this stage's
        }
    return out


@pytest.fixture(scope="module")
def small_checkpoints(tmp_path_factory):
    from kestrel.models.checkpoint import make_model

    root = tmp_path_factory.mktemp("small")
    return {f: str(make_model(f, "small", root / f, seed=1, dtype=torch.bfloat16)) for f in FAMILIES}


@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(tp=2),  # experts split inside
        ParallelLayout(tp=2, dp_attn=2),  # whole heads per rank
        ParallelLayout(pp=2),  # each stage: its 4 layers, the first the embedding, the last the norm and LM head
    ],
    ids=["tp2", "dp-attn2-tp2", "pp2"],
)
def test_plan_equals_what_every_rank_allocates(layout, small_checkpoints):
    ranks = spawn_ranks(_allocated, layout, small_checkpoints)
    for family, path in small_checkpoints.items():
        cfg = load_model_config(path)
        lay = Layout(
            gpus=layout.world,
            tp=layout.tp,
            ep=layout.ep,
            dp_attn=layout.dp_attn,
            pcp=layout.pcp,
            pp=layout.pp,
            gpu_mem_gib=64,
            context_len=4096,
        )
        p = plan(cfg, Layout(**{**vars(lay), "weight_format": "bf16", "kv_format": "bf16"}))
        assert len(p.stages) == layout.pp and p.attention_groups == layout.dp_attn  # one engine over all GPUs
        for got in ranks:
            got = got[family]
            stage = p.stages[got["stage"]]
            # The planner prices every weight at 2 bytes; the router, A_log and dt_bias stay fp32 (4) in the engine.
            assert got["weights"] - 2 * got["fp32_params"] == stage.weight_bytes
            assert got["state_per_request"] == stage.kda_state_bytes_per_request
            # bf16 latents and rope keys; the planner's index keys are FP8 (+ an fp32 scale), the engine's bf16.
            assert got["kv_per_token"] == stage.kv_bytes_per_token + got["dsa_layers"] * (cfg.index_head_dim - 4)
        if layout.pp == 1:
            assert ranks[0][family] == ranks[-1][family]  # every rank of these layouts holds the same amount
        else:  # the stages split the model's weights: each holds its layers and ends, nothing twice
            whole = memory.weight_bytes(build_model(cfg, torch.bfloat16, "meta"))
            assert ranks[0][family]["weights"] + ranks[1][family]["weights"] == whole


def _dcp_pool(groups, path: str, page_size: int) -> float:
    """KV pool bytes per token of this rank's runner, sized as the engine sizes it (8 pages of `page_size`)."""
    from kestrel.dist.runner import DistModelRunner
    from kestrel.dist.tensor_parallel import load_sharded_model

    model, _ = load_sharded_model(path, groups, torch.bfloat16)
    if groups.rank == 0:
        runner = DistModelRunner(model, 8, page_size, 1, torch.bfloat16, groups)
    else:
        runner = DistModelRunner.follower(model, torch.bfloat16, groups)
    kv = runner.kv
    tensors = [*kv.latent.values(), *kv.rope_key.values(), *(t for t in kv.index_key.values() if t is not None)]
    return sum(t.numel() * t.element_size() for t in tensors) / ((runner.scratch_page + 1) * page_size)


def test_plan_kv_per_rank_under_dcp_equals_the_engine_pool(small_checkpoints):
    """DCP 2 within TP 2: each rank's pool holds half of every page, as the planner's per-rank KV bytes say."""
    path = small_checkpoints["kimi_k3"]
    cfg = load_model_config(path)
    ranks = spawn_ranks(_dcp_pool, ParallelLayout(tp=2, dcp=2), path, 4)
    lay = dict(gpus=2, tp=2, gpu_mem_gib=64, context_len=4096, weight_format="bf16", kv_format="bf16")
    p, p1 = plan(cfg, Layout(**lay, dcp=2)), plan(cfg, Layout(**lay))
    n_dsa = sum(cfg.layer_kinds[i] == "dsa" for i in cfg.attention_layers)
    engine_format = n_dsa * (cfg.index_head_dim - 4)  # bf16 index keys in the engine, FP8 + scale in the planner
    assert p.kv_bytes_per_token_per_rank * 2 == p1.kv_bytes_per_token_per_rank
    assert ranks == [(p.kv_bytes_per_token_per_rank * 2 + engine_format) / 2] * 2
