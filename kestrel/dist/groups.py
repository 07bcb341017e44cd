"""One group builder: the world's ranks → pipeline, prefill-context, tensor-, attention- and expert-parallel axes.

The world is `pp` pipeline stages × `pcp` prefill-context ranks × `tp` tensor-parallel ranks: rank
r = (stage · pcp + c) · tp + t. Each (stage, c) is one TP block of `tp` consecutive ranks holding one copy of that
stage's layers (kestrel.dist.pp sends the residual stream from stage to stage; kestrel.dist.pcp splits long prefills
over the `pcp` blocks of a stage). Inside a TP block (SGLang's layout): decode context parallelism splits each
attention-TP group into `attn_tp / dcp` DCP groups of `dcp` consecutive ranks that shard the MLA / DSA KV by token
(kestrel.dist.dcp); attention runs `dp_attn` data-parallel groups of `tp / dp_attn` ranks each; MoE experts run over
the block's `tp` ranks as `ep` expert groups of `tp / ep` ranks that split each expert's intermediate dimension.
With t the rank's index in its block: attention-DP index t // attn_tp, attention-TP rank t % attn_tp; expert rank
t // moe_tp, moe-TP rank t % moe_tp. Every axis has a gloo CPU group (metadata: step plans, counts) and a device
group (tensors: gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kestrel.config import ConfigError, ModelConfig
from kestrel.plan import stage_sizes


PCP_SPLITS = ("zigzag", "roundrobin")


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
    pcp_split: str = "zigzag"  # how a prefill's tokens go to PCP ranks: zigzag (2·pcp blocks) | roundrobin
    pcp_block: int = 64  # round-robin: tokens per block
    pp_partition: tuple[int, ...] | None = None  # layers per stage (None: even, the first stages take the rest)
    pp_micro_batches: int = 0  # micro-batches a step is cut into so that stages overlap (0: one per stage)

    @property
    def world(self) -> int:
        return self.tp * self.pcp * self.pp

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp_attn

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    def stage_layers(self, n_layers: int, stage: int) -> range:
        """Layers of one pipeline stage (the split `kestrel plan` prices)."""
        sizes = stage_sizes(n_layers, self.pp, self.pp_partition)
        start = sum(sizes[:stage])
        return range(start, start + sizes[stage])

    def validate(self, cfg: ModelConfig | None = None) -> None:
        """Raise one ConfigError naming the flag of the first rule the layout breaks (for this model, when given)."""

        def need(cond: bool, flag: str, rule: str) -> None:
            if not cond:
                raise ConfigError(f"{flag}: {rule} (parallel layout tp={self.tp} pcp={self.pcp} pp={self.pp})")

        for name in ("tp", "ep", "dp_attn", "dcp", "pcp", "pp"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')}", "must be >= 1")
        need(self.tp % self.dp_attn == 0, "--dp-attn", "tp % dp_attn == 0 (attention-DP groups split the TP ranks)")
        need(self.attn_tp % self.dcp == 0, "--dcp", f"attention tp ({self.attn_tp}) % dcp ({self.dcp}) == 0")
        need(self.dcp == 1 or self.dp_attn == 1, "--dcp", "dcp > 1 with dp_attn > 1 is not supported yet")
        need(self.dcp_interleave >= 1, "--dcp-interleave", "must be >= 1")
        need(self.dcp_candidates >= 1, "--dcp-topk-candidates", "must be >= 1")
        need(self.dcp_merge in ("alltoall", "allgather"), "--dcp-merge", "alltoall or allgather")
        need(self.tp % self.ep == 0, "--ep", "tp % ep == 0 (expert groups split the TP ranks)")
        need(self.pcp_split in PCP_SPLITS, "--pcp-split", " or ".join(PCP_SPLITS))
        need(self.pcp_block >= 1, "--pcp-block", "must be >= 1")
        for name, other in (("dcp", self.dcp), ("dp_attn", self.dp_attn)):
            need(self.pcp == 1 or other == 1, "--pcp", f"pcp > 1 with {name} > 1 is not supported yet")
        need(self.pp == 1 or self.dp_attn == 1, "--pp", "pp > 1 with dp_attn > 1 is not supported yet")
        need(self.pp_micro_batches >= 0, "--pp-micro-batches", "must be >= 0 (0: one per stage)")
        part = self.pp_partition
        flag = "--pp-partition (or KESTREL_PP_LAYER_PARTITION)"
        if part is not None:
            need(len(part) == self.pp, flag, f"{len(part)} entries {list(part)}, needs one per stage (--pp {self.pp})")
            need(min(part) >= 1, flag, f"{list(part)}: every stage needs at least one layer")
        if cfg is None:
            return
        layers = cfg.num_hidden_layers
        need(self.pp <= layers, "--pp", f"{self.pp} stages for {layers} layers: every stage needs a layer")
        if part is not None:
            need(sum(part) == layers, flag, f"{list(part)} sums to {sum(part)}, the model has {layers} layers")
        heads = {"num_attention_heads": cfg.num_attention_heads if cfg.attention_layers else 0}
        heads["kda_num_heads"] = cfg.kda_num_heads if cfg.kda_layers else 0
        for name, n in heads.items():
            need(n % self.attn_tp == 0, "--tp", f"{name} ({n}) % attention tp ({self.attn_tp}) == 0")
        moe = "moe" in cfg.mlp_kinds
        if moe:
            need(cfg.moe_intermediate_size % self.moe_tp == 0, "--ep", "moe_intermediate_size % (tp / ep) == 0")
            if self.expert_map is not None:
                flag = "--ep-expert-map"
                need(len(self.expert_map) == cfg.num_experts, flag, f"one owner per expert ({cfg.num_experts})")
                need(all(0 <= o < self.ep for o in self.expert_map), flag, f"owners in [0, {self.ep})")
                need(set(self.expert_map) == set(range(self.ep)), flag, "every EP rank needs an expert")
            else:
                need(cfg.num_experts % self.ep == 0, "--ep", f"num_experts ({cfg.num_experts}) % ep == 0, or a map")
        dense = [cfg.intermediate_size] if "dense" in cfg.mlp_kinds else []
        shared = [cfg.moe_intermediate_size * cfg.num_shared_experts] if moe and cfg.num_shared_experts else []
        for size in dense + shared:
            need(size % self.tp == 0, "--tp", f"dense / shared-expert intermediate size ({size}) % tp == 0")
        if cfg.routed_expert_hidden_size:
            need(cfg.routed_expert_hidden_size % self.tp == 0, "--tp", "routed_expert_hidden_size % tp == 0")

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
    world: Group  # every rank of the job (rank 0 broadcasts each step over it)
    attn_tp: Group
    attn_dp: Group  # the ranks with this rank's attention-TP index, one per attention-DP group
    moe_tp: Group
    moe_ep: Group
    dcp: Group = field(default_factory=lambda: Group([0], 0))  # the ranks sharding this rank's MLA KV by token
    tp: Group = field(default_factory=lambda: Group([0], 0))  # this rank's TP block (one copy of a stage's layers)
    pcp: Group = field(default_factory=lambda: Group([0], 0))  # this stage's ranks with this rank's TP index
    pp: Group = field(default_factory=lambda: Group([0], 0))  # one rank per stage, this rank's (c, t) in each
    timeout_s: float = 60.0  # collectives and point-to-point transfers fail after this

    @property
    def tp_rank(self) -> int:
        return self.rank % self.layout.tp

    @property
    def dp_index(self) -> int:
        return self.tp_rank // self.layout.attn_tp

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.layout.moe_tp

    @property
    def stage(self) -> int:
        return self.rank // (self.layout.tp * self.layout.pcp)


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
    a, m, d, n, c = layout.attn_tp, layout.moe_tp, layout.dcp, layout.tp, layout.pcp
    blocks = [b * n for b in range(world // n)]  # first rank of every TP block

    def per_block(sets: list[list[int]]) -> list[list[int]]:
        return [[base + r for r in ranks] for base in blocks for ranks in sets]

    def axis(sets: list[list[int]]) -> Group:
        return _axis(sets, rank, backend, timeout)

    groups = Groups(
        layout,
        rank,
        axis([list(range(world))]),
        axis(per_block([list(range(g * a, (g + 1) * a)) for g in range(n // a)])),
        axis(per_block([list(range(j, n, a)) for j in range(a)])),
        axis(per_block([list(range(e * m, (e + 1) * m)) for e in range(n // m)])),
        axis(per_block([list(range(j, n, m)) for j in range(m)])),
        timeout_s=timeout.total_seconds(),
    )
    groups.dcp = axis(per_block([list(range(g * d, (g + 1) * d)) for g in range(n // d)]))
    groups.tp = axis(per_block([list(range(n))]))
    stage = n * c
    groups.pcp = axis([[s * stage + i * n + t for i in range(c)] for s in range(layout.pp) for t in range(n)])
    groups.pp = axis([[s * stage + j for s in range(layout.pp)] for j in range(stage)])
    _CURRENT = groups
    return groups


def set_current_groups(groups: Groups | None) -> None:
    global _CURRENT
    _CURRENT = groups
