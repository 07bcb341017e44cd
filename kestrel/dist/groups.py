"""One group builder: the world's ranks → tensor-, attention-, expert-parallel axes, each a pair of groups.

Axes (SGLang's layout): the world is `tp` ranks (`pp` and `pcp` are reserved axes of the next issue and must be
1 here). Decode context parallelism splits each attention-TP group into `attn_tp / dcp` DCP groups of `dcp`
consecutive ranks that shard the MLA / DSA KV by token (kestrel.dist.dcp).
Attention runs `dp_attn` data-parallel groups of `tp / dp_attn` ranks each; MoE experts run over
all `tp` ranks as `ep` expert groups of `tp / ep` ranks that split each expert's intermediate dimension.
Rank r: attention-DP index r // attn_tp, attention-TP rank r % attn_tp; expert rank r // moe_tp, moe-TP rank
r % moe_tp. Every axis has a gloo CPU group (metadata: step plans, counts) and a device group (tensors: gloo on
CPU, NCCL on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kestrel.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel axes; `expert_map` (owner EP rank per expert) allows an uneven expert split."""

    tp: int = 1
    ep: int = 1
    dp_attn: int = 1
    dcp: int = 1
    pcp: int = 1
    pp: int = 1
    expert_map: tuple[int, ...] | None = None
    dcp_interleave: int = 1  # consecutive tokens kept together on one DCP rank
    dcp_candidates: int = 384  # C: DSA top-k candidates each DCP rank sends first
    dcp_merge: str = "alltoall"  # how partial attention outputs are combined: alltoall | allgather

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp_attn

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    def validate(self, cfg: ModelConfig | None = None) -> None:
        """Raise one ConfigError naming the first rule the layout breaks (for this model, when given)."""

        def need(cond: bool, rule: str) -> None:
            if not cond:
                raise ConfigError(f"parallel layout tp={self.tp} ep={self.ep} dp_attn={self.dp_attn}: {rule}")

        for name in ("tp", "ep", "dp_attn", "dcp", "pcp", "pp"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1")
        for name in ("pcp", "pp"):
            need(getattr(self, name) == 1, f"{name} > 1 is not supported yet (context/pipeline parallelism)")
        need(self.tp % self.dp_attn == 0, "tp % dp_attn == 0 (attention-DP groups split the TP ranks)")
        need(self.attn_tp % self.dcp == 0, f"attention tp ({self.attn_tp}) % dcp ({self.dcp}) == 0")
        need(self.dcp == 1 or self.dp_attn == 1, "dcp > 1 with dp_attn > 1 is not supported yet")
        need(self.dcp_interleave >= 1 and self.dcp_candidates >= 1, "dcp_interleave and dcp_candidates >= 1")
        need(self.dcp_merge in ("alltoall", "allgather"), "dcp_merge is alltoall or allgather")
        need(self.tp % self.ep == 0, "tp % ep == 0 (expert groups split the TP ranks)")
        if cfg is None:
            return
        heads = {"num_attention_heads": cfg.num_attention_heads if cfg.attention_layers else 0}
        heads["kda_num_heads"] = cfg.kda_num_heads if cfg.kda_layers else 0
        for name, n in heads.items():
            need(n % self.attn_tp == 0, f"{name} ({n}) % attention tp ({self.attn_tp}) == 0")
        moe = "moe" in cfg.mlp_kinds
        if moe:
            need(cfg.moe_intermediate_size % self.moe_tp == 0, "moe_intermediate_size % (tp / ep) == 0")
            if self.expert_map is not None:
                need(
                    len(self.expert_map) == cfg.num_experts, f"expert_map has one owner per expert ({cfg.num_experts})"
                )
                need(all(0 <= o < self.ep for o in self.expert_map), f"expert_map owners in [0, {self.ep})")
                need(set(self.expert_map) == set(range(self.ep)), "expert_map gives every EP rank an expert")
            else:
                need(cfg.num_experts % self.ep == 0, f"num_experts ({cfg.num_experts}) % ep == 0, or an expert_map")
        dense = [cfg.intermediate_size] if "dense" in cfg.mlp_kinds else []
        shared = [cfg.moe_intermediate_size * cfg.num_shared_experts] if moe and cfg.num_shared_experts else []
        for size in dense + shared:
            need(size % self.tp == 0, f"dense / shared-expert intermediate size ({size}) % tp == 0")
        if cfg.routed_expert_hidden_size:
            need(cfg.routed_expert_hidden_size % self.tp == 0, "routed_expert_hidden_size % tp == 0")

    def owners(self, num_experts: int) -> list[int]:
        """Owner EP rank of every expert: the map, or contiguous equal blocks."""
        if self.expert_map is not None:
            return list(self.expert_map)
        per = num_experts // self.ep
        return [e // per for e in range(num_experts)]


@dataclass
class Group:
    """One axis group this rank belongs to: its ranks, this rank's index, and the two process groups."""

    ranks: list[int]
    rank: int
    device_group: object | None = None  # None: a group of one (no collective is ever issued)
    cpu_group: object | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class Groups:
    layout: ParallelLayout
    rank: int
    world: Group
    attn_tp: Group
    attn_dp: Group  # the ranks with this rank's attention-TP index, one per attention-DP group
    moe_tp: Group
    moe_ep: Group
    dcp: Group = field(default_factory=lambda: Group([0], 0))  # the ranks sharding this rank's MLA KV by token

    @property
    def dp_index(self) -> int:
        return self.rank // self.layout.attn_tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.layout.moe_tp


_CURRENT: Groups | None = None


def current_groups() -> Groups | None:
    """The groups of this process (None when it runs alone)."""
    return _CURRENT


def single_groups() -> Groups:
    """World of one: every axis is this rank alone."""
    one = Group([0], 0)
    return Groups(ParallelLayout(), 0, one, one, one, one, one)


def _axis(all_sets: list[list[int]], rank: int, backend: str, timeout) -> Group:
    """Create every group of one axis (all ranks must create all of them, in order); keep this rank's."""
    mine = None
    for ranks in all_sets:
        if len(ranks) == 1:
            grp = Group(ranks, 0)
        else:
            dev = dist.new_group(ranks, backend=backend, timeout=timeout)
            cpu = dist.new_group(ranks, backend="gloo", timeout=timeout)
            grp = Group(ranks, ranks.index(rank) if rank in ranks else -1, dev, cpu)
        if rank in ranks:
            mine = grp
    return mine


def build_groups(layout: ParallelLayout, device: torch.device, timeout) -> Groups:
    """Create all axis groups of an initialised default process group (collective: every rank calls it)."""
    global _CURRENT
    layout.validate()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world:
        raise ConfigError(f"parallel layout needs {layout.world} ranks, the process group has {world}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    a, m = layout.attn_tp, layout.moe_tp
    n = layout.tp
    groups = Groups(
        layout,
        rank,
        _axis([list(range(n))], rank, backend, timeout),
        _axis([list(range(g * a, (g + 1) * a)) for g in range(n // a)], rank, backend, timeout),
        _axis([list(range(j, n, a)) for j in range(a)], rank, backend, timeout),
        _axis([list(range(e * m, (e + 1) * m)) for e in range(n // m)], rank, backend, timeout),
        _axis([list(range(j, n, m)) for j in range(m)], rank, backend, timeout),
    )
    d = layout.dcp
    groups.dcp = _axis([list(range(g * d, (g + 1) * d)) for g in range(n // d)], rank, backend, timeout)
    _CURRENT = groups
    return groups


def set_current_groups(groups: Groups | None) -> None:
    global _CURRENT
    _CURRENT = groups
