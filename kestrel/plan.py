"""Memory / capacity planner (`kestrel plan`): weights, MLA+indexer KV and KDA state per GPU for a layout.

Plain integer arithmetic over a `ModelConfig`, so a deployment can be sized before any GPU is touched.
The layout follows SGLang's vocabulary: `tp` GPUs per pipeline stage copy, `pcp` copies of every stage
(`gpus = tp × pcp × pp × replicas`); attention runs in `dp_attn` groups of `tp / dp_attn` GPUs; MLA KV is
replicated across a group's TP ranks (one latent per token cannot be split by head) and only `dcp` shards it, by
token. Prefill context parallelism shards no memory: each of the `pcp` copies runs 1/pcp of every prompt's tokens
and keeps the whole KV and KDA state of its requests (decode runs on every copy).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kestrel.config import ModelConfig, load_model_config, model_config_from_dict

GIB = 1 << 30
DEFAULT_PRESET = "kimi-k3.1-pro"
DRAFT_KV_RING_FRACTION = 0.15  # seeds' tuning notes: the DFlash draft KV ring "adds ~15% target KV"
CONV_STATE_BYTES = 2  # KDA conv inputs are kept in bf16; the recurrent state is always fp32


class PlanError(ValueError):
    """A layout Kestrel cannot serve; the message names the offending flag."""


# ---------------------------------------------------------------------------------------------------------
# KV formats
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVFormat:
    """Storage of one token in one MLA/DSA layer: quantised latent + bf16 rope key + quantised index key.

    A part of `n` elements costs `n * bits / 8` value bytes plus `scale_bytes` per `group` elements
    (`group=None`: one scale for the whole vector).
    """

    latent_bits: int
    latent_scale_bytes: int
    latent_group: int | None
    index_bits: int
    index_scale_bytes: int
    index_group: int | None


def _part_bytes(n: int, bits: int, scale_bytes: int, group: int | None) -> int:
    groups = (1 if n else 0) if group is None else math.ceil(n / group)
    return n * bits // 8 + groups * scale_bytes


# Per token per DSA layer at K3.1 dims (latent 512, rope 64 in bf16 = 128 B, index key 128):
#   bf16:  latent 512×2 = 1024 + rope 128 = 1152 B; FP8 index 128 + 4 B fp32 scale = 132 B  → 1284 B
#   fp8:   FlashMLA layout: 512 FP8 + 4 fp32 scales (one per 128) = 16 B + rope 128 = 656 B; index 132 B → 788 B
#   nvfp4: NVFP4 latent 512/2 = 256 + one FP8 scale per 16 = 32 → 288 + rope 128 = 416 B;
#          MXFP4 index 128/2 = 64 + one E8M0 scale per 32 = 4 → 68 B                                      → 484 B
KV_FORMATS: dict[str, KVFormat] = {
    "bf16": KVFormat(16, 0, None, 8, 4, None),
    "fp8": KVFormat(8, 4, 128, 8, 4, None),
    "nvfp4": KVFormat(4, 1, 16, 4, 1, 32),
}
KV_FORMATS["fp8_e4m3"] = KV_FORMATS["fp8"]  # the engine's --kv-cache-dtype name of the same layout

# Routed-expert bytes per parameter; every other weight is bf16. MXFP4 = 4-bit values + one E8M0 scale
# per 32 = 4.25 bits; FP8 block scales (one per 128×128) are negligible.
EXPERT_BYTES_PER_PARAM = {"mxfp4": 4.25 / 8, "fp8": 1.0, "bf16": 2.0}
DENSE_BYTES_PER_PARAM = 2


def kv_bytes_per_token_layer(cfg: ModelConfig, kind: str, kv_format: str) -> int:
    """Bytes of one token in one attention layer (the index key only in DSA layers)."""
    fmt = KV_FORMATS[kv_format]
    latent = _part_bytes(cfg.kv_lora_rank, fmt.latent_bits, fmt.latent_scale_bytes, fmt.latent_group)
    rope = cfg.qk_rope_head_dim * 2
    index = 0
    if kind == "dsa":
        index = _part_bytes(cfg.index_head_dim, fmt.index_bits, fmt.index_scale_bytes, fmt.index_group)
    return latent + rope + index


# ---------------------------------------------------------------------------------------------------------
# Parameter counts, grouped by how they shard
# ---------------------------------------------------------------------------------------------------------


@dataclass
class LayerParams:
    """One decoder layer's parameters by sharding: `heads` split over attention TP, `mlp` and `experts`
    over the stage's TP (experts: EP × MoE-TP = TP), `replicated` copied on every rank."""

    heads: int = 0
    replicated: int = 0
    mlp: int = 0
    experts: int = 0

    @property
    def total(self) -> int:
        return self.heads + self.replicated + self.mlp + self.experts


def layer_params(cfg: ModelConfig, i: int) -> LayerParams:
    """Mirrors the modules in `kestrel.models` (a test holds the two equal)."""
    d, p = cfg.hidden_size, LayerParams()
    p.replicated += 2 * d  # input / post-attention norms
    if cfg.attn_res_block_size:
        p.replicated += 4 * d  # two AttnRes projections (d→1) and their norms
    if cfg.layer_kinds[i] == "kda":
        h, k = cfg.kda_num_heads, cfg.kda_head_dim
        c = h * k
        # q/k/v/o projections, depthwise conv, f_b, dt_bias, A_log, b_proj
        p.heads += 4 * d * c + 3 * c * cfg.kda_conv_size + k * c + c + h + d * h
        p.replicated += d * k + k  # f_a (rank-k bottleneck) and the output norm over head_dim
        if cfg.kda_full_rank_gate:
            p.heads += d * c
        else:
            p.replicated += d * k
            p.heads += k * c
    else:
        n, r, rope, bias = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.attention_bias
        if cfg.q_lora_rank:
            q = cfg.q_lora_rank
            p.replicated += d * q + q + (q if bias else 0)
            p.heads += q * n * cfg.qk_head_dim
        else:
            p.heads += d * n * cfg.qk_head_dim
        p.replicated += d * (r + rope) + r + ((r + rope) if bias else 0) + (d if bias else 0)
        p.heads += r * n * (cfg.qk_nope_head_dim + cfg.v_head_dim) + n * cfg.v_head_dim * d
        if cfg.mla_use_output_gate:
            p.heads += d * n * cfg.v_head_dim
        if cfg.layer_kinds[i] == "dsa":  # the indexer is replicated: every rank scores every token
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            p.replicated += (cfg.q_lora_rank or d) * ih * idim + d * idim + 2 * idim + d * ih
    if cfg.mlp_kinds[i] == "dense":
        p.mlp += 3 * d * cfg.intermediate_size
        return p
    latent = cfg.routed_expert_hidden_size
    p.replicated += cfg.num_experts * d  # router
    if latent:
        p.mlp += 2 * d * latent
        p.replicated += latent if cfg.latent_moe_use_norm else 0
    p.experts += cfg.num_experts * 3 * cfg.moe_intermediate_size * (latent or d)
    p.mlp += 3 * d * cfg.moe_intermediate_size * cfg.num_shared_experts
    return p


def param_totals(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active-per-token) parameters of the whole model."""
    layers = [layer_params(cfg, i) for i in range(cfg.num_hidden_layers)]
    ends = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size
    ends += 2 * cfg.hidden_size if cfg.attn_res_block_size else 0
    total = ends + sum(p.total for p in layers)
    experts = sum(p.experts for p in layers)
    active = total - experts + (experts * cfg.num_experts_per_tok // cfg.num_experts if experts else 0)
    return total, active


# ---------------------------------------------------------------------------------------------------------
# The K3.1 Pro preset
# ---------------------------------------------------------------------------------------------------------


def _k31_layer_layout(n_layers: int = 93) -> tuple[list[int], list[int]]:
    """1-based (kda, full) layers: every 4th layer DSA, plus the last (as Kimi Linear ends on full attention)."""
    full = [i + 1 for i in range(n_layers) if i % 4 == 3 or i == n_layers - 1]
    kda = [i + 1 for i in range(n_layers) if i + 1 not in full]
    assert (len(kda), len(full)) == (69, 24), (len(kda), len(full))
    return kda, full


def kimi_k31_pro_config() -> ModelConfig:
    """Kimi K3.1 Pro as published (93 layers: 69 KDA + 24 DSA, hidden 7168, 896 experts, 16 + 2 shared).

    The seeds do not give the expert widths; routed experts run in a 3584-wide latent with intermediate
    3072 (shared experts 2 × 3072 on the full width), a dense first layer of 18432, DeepSeek-like MLA
    (32 heads, q rank 1536, nope/v 128, rope 64) and AttnRes blocks of 6 (norms only). The config formula
    then gives 2.78T total / 102B active parameters against the stated 2.8T / 104B; weight bytes come
    from that formula (see `plan`).
    """
    kda, full = _k31_layer_layout()
    text = {
        "model_type": "kimi_k3_text",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "num_hidden_layers": 93,
        "intermediate_size": 18432,
        "first_k_dense_replace": 1,
        "num_attention_heads": 32,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "hidden_act": "situ",
        "attn_res_block_size": 6,
        "model_max_length": 1048576,
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": full,
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
    }
    return model_config_from_dict({"model_type": "kimi_k3", "text_config": text})


PRESETS = {DEFAULT_PRESET: kimi_k31_pro_config}


def resolve_model(name_or_path: str) -> ModelConfig:
    """A built-in preset by name, else a checkpoint folder or config.json."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    return load_model_config(name_or_path)


# ---------------------------------------------------------------------------------------------------------
# Layout and plan
# ---------------------------------------------------------------------------------------------------------


def stage_sizes(n_layers: int, pp: int, partition: list[int] | tuple[int, ...] | None = None) -> list[int]:
    """Layers per pipeline stage: the partition, or equal shares with the remainder on the first stages (the
    engine's split too, kestrel.dist.groups.ParallelLayout)."""
    return list(partition) if partition else [n_layers // pp + (s < n_layers % pp) for s in range(pp)]


@dataclass
class Layout:
    """Deployment knobs; each maps one-to-one onto a `kestrel plan` flag."""

    gpus: int = 8
    tp: int = 8
    dcp: int = 1
    dp_attn: int = 1
    ep: int = 1
    pcp: int = 1
    pp: int = 1
    pp_partition: list[int] | None = None
    gpu_mem_gib: float = 268.0  # one GB300 (288 GB), the seeds' hardware: the preset's TP8 layout fits on 8
    mem_fraction: float = 0.9
    kv_format: str = "fp8"
    weight_format: str = "mxfp4"
    context_len: int = 1 << 20
    max_running_requests: int | None = None
    speculative_algorithm: str | None = None
    draft_kv_ring: bool | None = None

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp_attn

    @property
    def ring(self) -> bool:
        """The DFlash draft KV ring is on by default whenever DFlash is."""
        dflash = (self.speculative_algorithm or "").lower() == "dflash"
        return dflash if self.draft_kv_ring is None else self.draft_kv_ring

    def validate(self, cfg: ModelConfig) -> None:
        def need(cond: bool, flag: str, why: str) -> None:
            if not cond:
                raise PlanError(f"--{flag}: {why}")

        for flag in ("gpus", "tp", "dcp", "dp_attn", "ep", "pcp", "pp", "context_len"):
            need(getattr(self, flag) >= 1, flag.replace("_", "-"), "must be >= 1")
        need(self.gpus % self.tp == 0, "tp", f"{self.tp} does not divide --gpus {self.gpus}")
        need(self.gpus % (self.tp * self.pp) == 0, "pp", f"--tp × --pp = {self.tp * self.pp} must divide --gpus")
        per_engine = self.tp * self.pcp * self.pp
        need(self.gpus % per_engine == 0, "pcp", f"--tp × --pcp × --pp = {per_engine} must divide --gpus")
        for flag, other in (("dcp", self.dcp), ("dp-attn", self.dp_attn)):
            need(self.pcp == 1 or other == 1, "pcp", f"--pcp > 1 with --{flag} > 1 is not supported by the engine")
        need(self.tp % self.dp_attn == 0, "dp-attn", f"{self.dp_attn} does not divide --tp {self.tp}")
        need(self.attn_tp % self.dcp == 0, "dcp", f"{self.dcp} must divide the attention TP size {self.attn_tp}")
        need(self.tp % self.ep == 0, "ep", f"{self.ep} does not divide --tp {self.tp} (MoE spans a stage's TP)")
        need(not cfg.num_experts or cfg.num_experts % self.ep == 0, "ep", f"must divide {cfg.num_experts} experts")
        if cfg.kda_layers:
            why = f"{cfg.kda_num_heads} KDA heads do not split over attention TP {self.attn_tp}"
            need(cfg.kda_num_heads % self.attn_tp == 0, "tp", why)
        if cfg.attention_layers:
            need(
                cfg.num_attention_heads % self.attn_tp == 0,
                "tp",
                f"{cfg.num_attention_heads} MLA heads do not split over attention TP {self.attn_tp}",
            )
        need(self.pp <= cfg.num_hidden_layers, "pp", f"more stages than {cfg.num_hidden_layers} layers")
        if self.pp_partition is not None:
            need(len(self.pp_partition) == self.pp, "pp-partition", f"needs {self.pp} entries")
            need(min(self.pp_partition) >= 1, "pp-partition", "every stage needs a layer")
            need(
                sum(self.pp_partition) == cfg.num_hidden_layers, "pp-partition", f"must sum to {cfg.num_hidden_layers}"
            )
        need(self.gpu_mem_gib > 0, "gpu-mem-gib", "must be > 0")
        need(0 < self.mem_fraction <= 1, "mem-fraction", "must be in (0, 1]")
        need(self.kv_format in KV_FORMATS, "kv-format", f"one of {sorted(KV_FORMATS)}")
        need(self.weight_format in EXPERT_BYTES_PER_PARAM, "weight-format", f"one of {sorted(EXPERT_BYTES_PER_PARAM)}")
        mrr = self.max_running_requests
        need(mrr is None or mrr >= 1, "max-running-requests", "must be >= 1")

    def stages(self, n_layers: int) -> list[range]:
        """Layer ranges per stage; remainder layers go to the first stages unless a partition is given."""
        sizes = stage_sizes(n_layers, self.pp, self.pp_partition)
        starts = [sum(sizes[:s]) for s in range(self.pp)]
        return [range(a, a + n) for a, n in zip(starts, sizes)]


@dataclass
class StagePlan:
    """Per-rank bytes of one pipeline stage (every rank of a stage holds the same amount)."""

    layers: list[int]
    weight_bytes: int
    kv_bytes_per_token: float
    kda_state_bytes_per_request: int
    free_bytes: int


@dataclass
class Plan:
    """What fits: per rank, per attention group (`tp / dp_attn` GPUs) and over all `gpus`.

    `max_cached_tokens` is per attention group after weights and a state pool of `state_pool_requests`
    (the given `max_running_requests`, else one slot per full-context request that fits). The prefix cache's KDA
    checkpoints are not in it: an engine sized by `mem_fraction` gives them `state_checkpoint_memory_ratio` of the
    KV pool's bytes on top (`kestrel.engine.capacity.pool_sizes`), so it holds 1 / (1 + ratio) of these tokens.
    """

    model: str
    layout: dict[str, Any]
    total_params: int
    active_params: int
    budget_bytes_per_rank: int
    weight_bytes_per_rank: int
    free_bytes_per_rank: int
    kv_bytes_per_token_per_layer: int
    kv_bytes_per_token_per_rank: float
    kda_recurrent_bytes_per_request_per_rank: int
    kda_conv_bytes_per_request_per_rank: int
    kda_state_bytes_per_request_per_rank: int
    attention_groups: int
    state_pool_requests: int
    max_concurrent_requests: int | None
    concurrency_bound: str
    max_cached_tokens: int | None
    max_cached_tokens_total: int | None
    full_context_requests: int | None
    full_context_requests_per_group: int | None
    fits: bool
    reason: str  # why the layout does not fit; "" when it does
    stages: list[StagePlan] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def kv_bytes_per_rank_for_tokens(self, tokens: int) -> float:
        """Per-rank KV bytes when `tokens` are spread evenly over the attention groups."""
        return tokens / self.attention_groups * self.kv_bytes_per_token_per_rank


def _stage_plan(cfg: ModelConfig, lay: Layout, layers: range, first: bool, last: bool, budget: int) -> StagePlan:
    tp, attn_tp = lay.tp, lay.attn_tp
    weights = 0.0
    kv = 0
    kda_layers = 0
    for i in layers:
        p = layer_params(cfg, i)
        dense = p.heads / attn_tp + p.replicated + p.mlp / tp
        weights += dense * DENSE_BYTES_PER_PARAM + p.experts / tp * EXPERT_BYTES_PER_PARAM[lay.weight_format]
        if cfg.layer_kinds[i] == "kda":
            kda_layers += 1
        else:
            kv += kv_bytes_per_token_layer(cfg, cfg.layer_kinds[i], lay.kv_format)
    vd = cfg.vocab_size * cfg.hidden_size
    if first:
        weights += vd / tp * DENSE_BYTES_PER_PARAM
    if last:
        tied_elsewhere = cfg.tie_word_embeddings and first
        weights += (0 if tied_elsewhere else vd / tp) * DENSE_BYTES_PER_PARAM
        weights += cfg.hidden_size * (3 if cfg.attn_res_block_size else 1) * DENSE_BYTES_PER_PARAM
    kv_rank = kv / lay.dcp * (1 + DRAFT_KV_RING_FRACTION if lay.ring and last else 1)
    heads = cfg.kda_num_heads // attn_tp if cfg.kda_layers else 0
    rec, conv = _kda_state_per_layer(cfg, heads)
    return StagePlan(list(layers), math.ceil(weights), kv_rank, kda_layers * (rec + conv), budget - math.ceil(weights))


def _kda_state_per_layer(cfg: ModelConfig, heads: int) -> tuple[int, int]:
    """(recurrent fp32 H×K×V, conv bf16 3·H·K×(kernel-1)) bytes of one request in one KDA layer on one rank."""
    k = cfg.kda_head_dim
    return heads * k * k * 4, 3 * heads * k * (cfg.kda_conv_size - 1) * CONV_STATE_BYTES


def _floor_div(a: float, b: float) -> int | None:
    """a // b for capacities: None when nothing limits (b == 0), 0 when a < 0."""
    return None if b <= 0 else max(0, math.floor(a / b))


def _min(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def plan(cfg: ModelConfig, layout: Layout | None = None, model: str = "") -> Plan:
    """Size weights, KV and KDA state per rank for `layout`; the tightest pipeline stage bounds capacity."""
    lay = layout or Layout()
    lay.validate(cfg)
    budget = int(lay.gpu_mem_gib * GIB * lay.mem_fraction)
    ranges = lay.stages(cfg.num_hidden_layers)
    stages = [_stage_plan(cfg, lay, r, s == 0, s == lay.pp - 1, budget) for s, r in enumerate(ranges)]
    groups = lay.dp_attn * (lay.gpus // (lay.tp * lay.pcp * lay.pp))
    ctx = lay.context_len

    full_fit = _min(
        [_floor_div(st.free_bytes, st.kda_state_bytes_per_request + ctx * st.kv_bytes_per_token) for st in stages]
    )
    mrr_group = None if lay.max_running_requests is None else math.ceil(lay.max_running_requests / lay.dp_attn)
    pool = mrr_group if mrr_group is not None else (full_fit or 0)
    tokens = _min(
        [_floor_div(st.free_bytes - pool * st.kda_state_bytes_per_request, st.kv_bytes_per_token) for st in stages]
    )
    full = full_fit if mrr_group is None else _min([mrr_group, None if tokens is None else tokens // ctx])
    # Concurrency per group: the smallest bound wins, and the plan names it.
    bounds: list[tuple[int | None, str]] = []
    if mrr_group is not None:
        bounds.append((mrr_group, "--max-running-requests"))
    elif cfg.kda_layers:
        bounds.append((pool, "state pool: one KDA slot per full-context request; set --max-running-requests"))
    state = _min([_floor_div(st.free_bytes, st.kda_state_bytes_per_request) for st in stages])
    bounds.append((state, "memory: KDA state"))
    if state is None or tokens:  # a pool that does not fit leaves 0 tokens; the misfit reason says so
        bounds.append((tokens, "KV cache: one token per request"))
    ceiling, bound = min(((v, b) for v, b in bounds if v is not None), key=lambda vb: vb[0], default=(None, ""))

    budget_text = f"the budget {_gib(budget)} (--gpu-mem-gib {lay.gpu_mem_gib:g} × --mem-fraction {lay.mem_fraction:g})"
    reason = ""
    if any(st.free_bytes <= 0 for st in stages):
        need = max(st.weight_bytes for st in stages)
        reason = f"weights need {_gib(need)} per GPU, over {budget_text}"
    elif tokens is not None and tokens <= 0:
        reason = (
            f"a state pool of {pool} requests per group needs {_gib(pool * stages[0].kda_state_bytes_per_request)} "
            f"per GPU, over the {_gib(min(st.free_bytes for st in stages))} left after weights"
        )
    elif ceiling is not None and ceiling < 1:
        reason = f"not one {ctx:,}-token request fits in {budget_text} after weights; lower --context-len"
    fits = not reason

    worst = max(stages, key=lambda st: (st.weight_bytes, st.kv_bytes_per_token))
    heads = cfg.kda_num_heads // lay.attn_tp if cfg.kda_layers else 0
    rec, conv = _kda_state_per_layer(cfg, heads)
    state_stage = max(stages, key=lambda st: st.kda_state_bytes_per_request)
    n_kda = sum(1 for i in state_stage.layers if cfg.layer_kinds[i] == "kda")
    attn_kind = next((cfg.layer_kinds[i] for i in cfg.attention_layers), "mla")
    total, active = param_totals(cfg)

    def times(v: int | None) -> int | None:
        return None if v is None else v * groups

    return Plan(
        model=model or cfg.model_type,
        layout=asdict(lay) | {"attn_tp": lay.attn_tp, "draft_kv_ring": lay.ring},
        total_params=total,
        active_params=active,
        budget_bytes_per_rank=budget,
        weight_bytes_per_rank=worst.weight_bytes,
        free_bytes_per_rank=min(st.free_bytes for st in stages),
        kv_bytes_per_token_per_layer=kv_bytes_per_token_layer(cfg, attn_kind, lay.kv_format),
        kv_bytes_per_token_per_rank=max(st.kv_bytes_per_token for st in stages),
        kda_recurrent_bytes_per_request_per_rank=n_kda * rec,
        kda_conv_bytes_per_request_per_rank=n_kda * conv,
        kda_state_bytes_per_request_per_rank=state_stage.kda_state_bytes_per_request,
        attention_groups=groups,
        state_pool_requests=pool,
        max_concurrent_requests=times(ceiling),
        concurrency_bound=bound,
        max_cached_tokens=tokens,
        max_cached_tokens_total=times(tokens),
        full_context_requests=times(full),
        full_context_requests_per_group=full,
        fits=fits,
        reason=reason,
        stages=stages,
        assumptions=[
            f"weights: routed experts {lay.weight_format} ({EXPERT_BYTES_PER_PARAM[lay.weight_format] * 8:g} bits), "
            "the rest bf16; experts and MLPs split over --tp (EP × MoE-TP), per-head attention weights over "
            "attention TP, indexer / latent down-projections / norms / router replicated; no draft-model weights",
            "budget = --gpu-mem-gib × --mem-fraction per GPU (activations and graphs live outside it)",
            "MLA + indexer KV is replicated across attention TP ranks and sharded by token over --dcp",
            "KDA state (fp32 recurrent + bf16 conv) is split by head over attention TP, not by --dcp",
            f"DFlash draft KV ring adds {DRAFT_KV_RING_FRACTION:.0%} of the target KV per token (last stage)",
            "--pcp copies of a stage each hold its weights and the whole KV and KDA state of their requests: PCP "
            f"splits each prefill (a rank computes 1/{lay.pcp} of a prompt's tokens), not memory",
            "--max-running-requests is per engine (tp × pcp × pp GPUs), split evenly over --dp-attn groups",
        ],
    )


# ---------------------------------------------------------------------------------------------------------
# Text output
# ---------------------------------------------------------------------------------------------------------


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:,.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _count(n: int) -> str:
    """2.8T, 101.9B, 7.6M: parameter counts at a readable scale."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _num(n: float | None) -> str:
    return "unbounded" if n is None else f"{n:,}"


def format_plan(p: Plan) -> str:
    """A readable table of the plan's headline figures."""
    lay = p.layout
    gpus = f"{lay['gpus']} GPU" + ("s" if lay["gpus"] != 1 else "")
    shape = (
        f"{gpus} · TP{lay['tp']} · attention DP{lay['dp_attn']} × TP{lay['attn_tp']} · "
        f"DCP{lay['dcp']} · EP{lay['ep']} · PCP{lay['pcp']} · PP{lay['pp']}"
    )
    rows = [
        ("model", f"{p.model} ({_count(p.total_params)} params, {_count(p.active_params)} active)"),
        ("layout", shape),
        (
            "KV format",
            f"{lay['kv_format']} ({p.kv_bytes_per_token_per_layer} B/token/layer)"
            + (", + DFlash draft KV ring" if lay["draft_kv_ring"] else ""),
        ),
        ("budget per GPU", _gib(p.budget_bytes_per_rank)),
        ("weights per GPU", _gib(p.weight_bytes_per_rank)),
        ("free per GPU", _gib(p.free_bytes_per_rank)),
        ("KV per token per GPU", f"{p.kv_bytes_per_token_per_rank:,.1f} B"),
        (
            "KDA state per request per GPU",
            f"{_mib(p.kda_state_bytes_per_request_per_rank)} "
            f"(recurrent {_mib(p.kda_recurrent_bytes_per_request_per_rank)})",
        ),
        ("attention groups", str(p.attention_groups)),
        ("state pool (requests per group)", str(p.state_pool_requests)),
        (
            "max concurrent requests",
            _num(p.max_concurrent_requests) + (f" (bound: {p.concurrency_bound})" if p.concurrency_bound else ""),
        ),
        ("max cached tokens per group", _num(p.max_cached_tokens)),
        (f"full {lay['context_len']:,}-token requests", _num(p.full_context_requests)),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)
