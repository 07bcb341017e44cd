"""Turn a model built on the meta device into this rank's shard, then allocate and load only that shard.

The layout (DESIGN.md, issue 13): MLA heads split over attention-TP (latent and rope key replicated, the DSA
indexer replicated so every rank selects the same top-k), `o_proj` row-parallel; KDA heads split (q/k/v/β/gate
projections, convs, `A_log`, `dt_bias`), low-rank gate factors replicated, `o_proj` row-parallel; dense MLPs and
shared experts split over TP; latent-MoE projections column-parallel; routed experts split over EP ranks
(`ParallelExperts`); the vocabulary split for the embedding and the LM head.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from kestrel.config import ModelConfig, load_model_config
from kestrel.dist.dp_attention import DPGathered
from kestrel.dist.groups import Groups
from kestrel.dist.moe import ParallelExperts
from kestrel.dist.pcp import wrap_kda_layers
from kestrel.dist.parallel import (
    ColumnParallelLinear,
    ParallelFusedLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    split_conv1d,
    split_vector,
)
from kestrel.dist.pp import keep_stage, stage_skip
from kestrel.models.decoder import CausalLM
from kestrel.models.layers.kda import KDAAttention
from kestrel.models.layers.mla import MLAAttention
from kestrel.models.layers.moe import DenseMLP, MoE
from kestrel.models.layers.rope import RotaryEmbedding
from kestrel.models.loader import build_model, load_weights


def shard_mla(m: MLAAttention, groups: Groups) -> None:
    g = groups.attn_tp
    m.in_proj = ParallelFusedLinear(m.in_proj, g, {"q_proj", "g_proj"} & set(m.in_proj.parts))
    if hasattr(m, "q_b_proj"):
        m.q_b_proj = ColumnParallelLinear(m.q_b_proj, g)
    m.kv_b_proj = ColumnParallelLinear(m.kv_b_proj, g)
    m.o_proj = RowParallelLinear(m.o_proj, g)
    m.n_heads //= g.size


def shard_kda(m: KDAAttention, groups: Groups) -> None:
    g = groups.attn_tp
    m.in_proj = ParallelFusedLinear(m.in_proj, g, {"q_proj", "k_proj", "v_proj", "b_proj", "g_proj"})
    m.conv1d = split_conv1d(m.conv1d, 3, g)
    m.f_b_proj = ColumnParallelLinear(m.f_b_proj, g)
    if m.g_b_proj is not None:
        m.g_b_proj = ColumnParallelLinear(m.g_b_proj, g)
    m.dt_bias = split_vector(m.dt_bias, g, "dt_bias")
    m.A_log = split_vector(m.A_log, g, "A_log")
    m.o_proj = RowParallelLinear(m.o_proj, g)
    m.n_heads //= g.size
    m.conv_dim //= g.size


def shard_mlp(m: DenseMLP, groups: Groups) -> None:
    m.gate_up_proj = ParallelFusedLinear(m.gate_up_proj, groups.tp, {"gate_proj", "up_proj"})
    m.down_proj = RowParallelLinear(m.down_proj, groups.tp)


def shard_moe(m: MoE, groups: Groups, dispatch: str) -> None:
    lay = groups.layout
    m.experts = ParallelExperts(
        m.experts, lay.owners(m.gate.n_experts), groups.moe_ep, groups.moe_tp, groups.tp, dispatch
    )
    if m.latent:
        m.routed_expert_down_proj = ColumnParallelLinear(m.routed_expert_down_proj, groups.tp, gather=True)
        m.routed_expert_up_proj = ColumnParallelLinear(m.routed_expert_up_proj, groups.tp, gather=True)
    if m.shared_experts is not None:
        shard_mlp(m.shared_experts, groups)


def shard_model(model: CausalLM, groups: Groups, dispatch: str = "allgather") -> None:
    """Replace every layer by its parallel twin, in place (on the meta device: nothing is allocated)."""
    with torch.device(model.device):
        _shard_layers(model, groups, dispatch)
    model.cfg = local_config(model.cfg, groups)


def _shard_layers(model: CausalLM, groups: Groups, dispatch: str) -> None:
    shared = shared_experts(model)
    for module in list(model.modules()):
        if isinstance(module, MLAAttention):
            shard_mla(module, groups)
        elif isinstance(module, KDAAttention):
            shard_kda(module, groups)
        elif isinstance(module, MoE):
            shard_moe(module, groups, dispatch)
        elif isinstance(module, DenseMLP) and module not in shared:
            shard_mlp(module, groups)
    inner = model.model  # a pipeline stage may hold neither end (kestrel.dist.pp)
    if inner.embed_tokens is not None:
        inner.embed_tokens = VocabParallelEmbedding(inner.embed_tokens, groups.tp)
    if model.lm_head is not None:
        head = ParallelLMHead(model.lm_head, groups.tp)
        if model.cfg.tie_word_embeddings:
            head.weight = inner.embed_tokens.weight
        model.lm_head = head


def shared_experts(model: nn.Module) -> set[nn.Module]:
    return {m.shared_experts for m in model.modules() if isinstance(m, MoE) and m.shared_experts is not None}


def local_config(cfg: ModelConfig, groups: Groups) -> ModelConfig:
    """The rank's view of the config: its attention heads (the cache pools are sized from it)."""
    a = groups.layout.attn_tp
    return dataclasses.replace(
        cfg, kda_num_heads=cfg.kda_num_heads // a, num_attention_heads=cfg.num_attention_heads // a
    )


def materialize(model: CausalLM, device: torch.device) -> None:
    """Allocate every meta parameter and buffer on `device` (uninitialised), keeping loader attributes and ties."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False)
                new.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
                done[id(p)] = new
            module._parameters[name] = done[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:  # meta: loaded from the checkpoint; others (expert maps) were built on the CPU
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device) if b.is_meta else b.to(device)
    cfg = model.model.cfg
    if isinstance(model.model.rotary, RotaryEmbedding):  # a derived buffer (inv_freq): recompute it
        with torch.device(device):
            model.model.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)


def load_sharded_model(
    path: str | Path,
    groups: Groups,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    dispatch: str = "allgather",
) -> tuple[CausalLM, ModelConfig]:
    """This rank's shard of the checkpoint: built on meta, sharded, allocated, then only its slices read."""
    cfg = load_model_config(path)
    lay = groups.layout
    lay.validate(cfg)
    model = build_model(cfg, dtype, "meta")
    skip = None
    if lay.pp > 1:  # this stage's layers (and ends) only
        keep_stage(model, lay, groups.stage)
        skip = stage_skip(cfg, lay, groups.stage)
    shard_model(model, groups, dispatch)
    materialize(model, torch.device(device))
    load_weights(model, path, progress=groups.rank == 0, skip=skip)
    if lay.dp_attn > 1:  # the embedding and MLPs run over every group's rows (wrapped once loaded)
        model.model.embed_tokens = DPGathered(model.model.embed_tokens, groups)
        for layer in model.model.layers:
            layer.mlp = DPGathered(layer.mlp, groups)
    if lay.pcp > 1:  # KDA layers compose their prefill segments over the PCP group (wrapped once loaded)
        wrap_kda_layers(model, groups.pcp)
    return model.eval(), cfg
