"""Feed-forward blocks: dense gated MLP and the routed MoE (sigmoid/softmax router, shared and latent experts)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import ModelConfig
from kestrel.models.layers import batch_invariant, cpu_kernels
from kestrel.models.layers.casts import cast, fp32
from kestrel.models.layers.constants import fp32_scalar
from kestrel.models.layers.derived import derived
from kestrel.models.layers.hookless import HooklessModule
from kestrel.models.layers.linear import FusedLinear, compiled_cpu_product_dtype
from kestrel.models.layers.moe_mxfp4 import MXFP4Experts
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.weight_loaders import expert_loader, set_loader

# In a compiled step, up to this many (token, expert) pairs run as gathered-weight batched matmuls.
GATHERED_MAX_PAIRS = 16
# Eager on CPU, up to this many pairs (decode steps up to batch 64 at top-4, verify blocks) take the compiled pair
# kernel: register tiles of one expert's rows against its weight rows, threaded over the weight rows. Measured on
# kimi_linear small's experts (12 x 384 -> 128, top-4), kernel vs grouped GEMMs with their sort/scatter: 3.4-3.9x at
# 4-32 pairs, 1.8x at 128, 2.0x at 256 on 2 threads; 1.2-3x up to 128 on 1 thread; and 2x the per-expert GEMV loop
# at batch 1. Prefill-sized calls keep the grouped GEMMs (MKL's packed GEMM wins from ~512 pairs).
KERNEL_MAX_PAIRS = 256


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU: β·tanh(gate/β)·sigmoid(gate) · (β_lin·tanh(up/β_lin) if β_lin else up), computed in fp32."""
    g, u = fp32(gate), fp32(up)
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta:
        u = linear_beta * torch.tanh(u / linear_beta)
    return cast(act * u, gate.dtype)


class GatedActivation:
    """act(gate, up) for the configured `hidden_act`."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.kind, self.beta, self.linear_beta = cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "situ":
            return situ(gate, up, self.beta, self.linear_beta)
        return F.silu(gate) * up


class DenseMLP(HooklessModule):
    def __init__(self, cfg: ModelConfig, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = GatedActivation(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(*self.gate_up_proj(x)))


class Router(HooklessModule):
    """fp32 router: choose with score + correction bias (grouped if configured), weight with the raw score."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.n_experts = cfg.num_experts_per_tok, cfg.num_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.activation, self.renormalize = cfg.router_activation, cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(fp32(x), fp32(self.weight))
        return logits.sigmoid() if self.activation == "sigmoid" else logits.softmax(dim=-1)

    def forward(self, x: torch.Tensor, forced_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [T, k] (fp32) and expert ids [T, k]; `forced_ids` replays a rollout's choice."""
        scores = self.scores(x)
        ids = self.choose(scores) if forced_ids is None else forced_ids.to(x.device, torch.long)
        return self.weights_for(scores, ids), ids

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        choice = scores + fp32(self.e_score_correction_bias)
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.n_experts // self.n_group)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0).bool()
            choice = choice.masked_fill(~group_mask.repeat_interleave(self.n_experts // self.n_group, 1), float("-inf"))
        return choice.topk(self.top_k, dim=-1).indices

    def weights_for(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routing weights of given experts: also used when a trainer replays a rollout's choices."""
        weights = scores.gather(1, ids)  # fp32 (see constants.py)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + fp32_scalar(1e-20))
        return weights * fp32_scalar(self.scaling)


class Experts(HooklessModule):
    """All routed experts as two stacked weights (fused gate|up and down), run as a grouped computation.

    The (token, expert) pairs are sorted by expert and every expert multiplies its contiguous segment: on CPU at
    inference as two grouped GEMMs (`torch._grouped_mm`, weights read in place, no per-expert Python loop),
    otherwise (training, other devices) one GEMM pair per expert. A compiled step with few pairs gathers their
    weights instead, which inductor fuses; with many it calls the segments as one opaque op.
    """

    def __init__(self, cfg: ModelConfig, hidden: int) -> None:
        super().__init__()
        n, inter = cfg.num_experts, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, inter))
        set_loader(self.gate_up_proj, expert_loader(halves=True), {(e, h) for e in range(n) for h in (0, 1)})
        set_loader(self.down_proj, expert_loader(halves=False), {(e, None) for e in range(n)})
        self.act = GatedActivation(cfg)
        self.lora = None  # per-expert LoRA terms (kestrel.models.lora), added to each pair's outputs, never merged

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if batch_invariant.active():
            return batch_invariant.experts(x, ids, weights, self.one_expert)
        if self.lora is not None and self.lora.active():
            return self.lora.forward(x, ids, weights)
        if torch.compiler.is_compiling() and ids.numel() <= GATHERED_MAX_PAIRS:
            return self._gathered(x, ids, weights)
        act = self.act
        args = (x, ids, weights, self.gate_up_proj, self.down_proj, act.kind, act.beta or 0.0, act.linear_beta or 0.0)
        if torch.compiler.is_compiling():
            return torch.ops.kestrel.expert_segments(*args)
        if self._kernel_applies(x, ids, weights):  # decode / verify sizes
            return expert_pairs_kernel(x, ids, weights, self.gate_up_proj, self.down_proj, self.act)
        if ids.shape[0] == 1 and not torch.is_grad_enabled():  # batch-1 decode: see expert_pairs
            gate_up = derived(self, "gate_up", self.gate_up_proj, lambda w: w.unbind(0))
            down = derived(self, "down", self.down_proj, lambda w: w.unbind(0))
            return expert_pairs(x, ids, weights, gate_up, down, *args[5:])
        return expert_segments(*args)  # eager: skip the op's dispatch (tens of microseconds a call)

    def _kernel_applies(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> bool:
        if ids.numel() > KERNEL_MAX_PAIRS:
            return False
        return (
            cpu_kernels.inference_on_cpu(x)
            and cpu_kernels.fp32_contiguous(x, weights, self.gate_up_proj, self.down_proj)
            and cpu_kernels.module() is not None
        )

    def one_expert(self, e: int, xs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Expert e on the rows routed to it (`tokens`: their token indices, for the rows' LoRA adapters)."""
        lora = self.lora if self.lora is not None and self.lora.active() else None
        gate, up = F.linear(xs, self.gate_up_proj[e]).chunk(2, dim=-1)
        if lora is not None:
            gate = gate + lora.expert_delta(e, "gate_proj", xs, tokens)
            up = up + lora.expert_delta(e, "up_proj", xs, tokens)
        h = self.act(gate, up)
        y = F.linear(h, self.down_proj[e])
        return y if lora is None else y + lora.expert_delta(e, "down_proj", h, tokens)

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each pair's expert weights gathered into two batched matmuls: inductor fuses the gather, no copy."""
        t, k = ids.shape
        flat, ct = ids.reshape(-1), compiled_cpu_product_dtype(x)  # fp32 on CPU: see there
        xs = x.repeat_interleave(k, dim=0)[:, :, None].to(ct)  # [T*k, D, 1]
        gate, up = torch.bmm(self.gate_up_proj[flat].to(ct), xs).squeeze(-1).chunk(2, dim=-1)
        h = self.act(gate.to(x.dtype), up.to(x.dtype))
        y = torch.bmm(self.down_proj[flat].to(ct), h[:, :, None].to(ct)).view(t, k, -1)
        return (y * weights[:, :, None]).sum(1).to(x.dtype)


class MoE(HooklessModule):
    """Σ weight·expert(x) + shared(x); latent MoE runs the experts on a down-projected x (K3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        latent = cfg.routed_expert_hidden_size
        if latent:
            self.routed_expert_down_proj = nn.Linear(cfg.hidden_size, latent, bias=False)
            self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
            self.routed_expert_up_proj = nn.Linear(latent, cfg.hidden_size, bias=False)
        self.latent = bool(latent)
        packed = cfg.routed_expert_format == "mxfp4"
        self.experts = (MXFP4Experts if packed else Experts)(cfg, latent or cfg.hidden_size)
        shared = cfg.moe_intermediate_size * cfg.num_shared_experts
        self.shared_experts = DenseMLP(cfg, cfg.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor, forced_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Output [T, D] and the expert ids used [T, k] (forced_ids replays a rollout's routing)."""
        weights, ids = self.gate(x, forced_ids)
        routed_in = self.routed_expert_down_proj(x) if self.latent else x
        routed = self.experts(routed_in, ids, weights)
        if self.latent:
            if self.routed_expert_norm is not None:
                routed = self.routed_expert_norm(routed)
            routed = self.routed_expert_up_proj(routed)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed, ids


def expert_segments(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: str,
    beta: float,
    linear_beta: float,
) -> torch.Tensor:
    """Σ_k weight·expert(x): the pairs sorted by expert, each expert's segment through its gate|up and down."""
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(gate_up_proj.shape[0], dtype=torch.long, device=x.device).index_add_(
        0, flat, torch.ones_like(flat)
    )
    token_of = order // ids.shape[1]
    # index_select, not x[token_of]: CPU advanced indexing copies element by element (4x slower at 16K pairs)
    gate, up = segment_linear(x.index_select(0, token_of), gate_up_proj, counts).chunk(2, dim=-1)
    h = situ(gate, up, beta, linear_beta or None) if act == "situ" else F.silu(gate) * up
    y = segment_linear(h, down_proj, counts) * weights.reshape(-1).index_select(0, order)[:, None]
    return torch.zeros_like(x).index_add_(0, token_of, y.to(x.dtype))


def expert_pairs(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor | Sequence[torch.Tensor],
    down_proj: torch.Tensor | Sequence[torch.Tensor],
    act: str,
    beta: float,
    linear_beta: float,
) -> torch.Tensor:
    """`expert_segments` for one token, one expert at a time: the grouped GEMM would also visit every idle expert and
    the sort/scatter bookkeeping costs more than the token's GEMMs. Bit-identical to `expert_segments` for one token:
    each expert sees the same one-row GEMM, and the terms are added in the same order (by expert id, from zero).
    The weights may be given as per-expert sequences (a module's cached views: no select op per pair)."""
    out, columns = None, weights.unbind(1)  # one view op for all k weight columns
    for e, j in sorted(zip(ids[0].tolist(), range(ids.shape[1]))):
        gate, up = F.linear(x, gate_up_proj[e]).chunk(2, dim=-1)
        h = situ(gate, up, beta, linear_beta or None) if act == "situ" else F.silu(gate) * up
        y = cast(F.linear(h, down_proj[e]) * columns[j], x.dtype)
        out = y if out is None else out.add_(y)  # the first term as it is: 0 + y is y, bit for bit
    return out


def expert_pairs_kernel(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: GatedActivation,
) -> torch.Tensor:
    """`expert_segments` for up to `KERNEL_MAX_PAIRS` pairs through the compiled CPU kernel (`experts_cpu.cpp`): the
    pairs grouped by expert and multiplied in register tiles against that expert's weight rows (no grouped GEMM over
    idle experts, no sort/scatter ops), the activation in PyTorch, and each token's terms added in ascending expert
    id from zero (as `expert_pairs`)."""
    kernels = cpu_kernels.module()
    ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.long().contiguous()
    rows, order = kernels.expert_pairs_up_fp32(x, ids, gate_up_proj)
    h = act(*rows.chunk(2, dim=-1)).contiguous()
    return kernels.expert_pairs_down_fp32(h, down_proj, ids, order, weights)


def segment_linear(xs: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `xs` grouped by expert (counts[e] rows for expert e, in order) times each expert's weight [E, o, i].

    One grouped GEMM on CPU at inference; elsewhere one GEMM per expert (autograd, and devices whose grouped GEMM
    takes only bf16).
    """
    if xs.device.type == "cpu" and not torch.is_grad_enabled():
        return torch._grouped_mm(xs, weight.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    parts = xs.split(counts.tolist())
    outs = [F.linear(part, weight[e]) for e, part in enumerate(parts) if len(part)]
    return torch.cat(outs) if outs else xs.new_zeros(0, weight.shape[1])


# An opaque op to torch.compile: its output shape is static, the loop and `_grouped_mm` (no fp32 meta kernel) hidden.
torch.library.custom_op("kestrel::expert_segments", mutates_args=())(expert_segments).register_fake(
    lambda x, *args: torch.empty_like(x)
)
