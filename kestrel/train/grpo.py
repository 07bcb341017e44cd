"""GRPO's arithmetic: group-normalised advantages, the zero-variance filter, and the token-level policy loss.

The loss of one token t of a rollout with advantage A (DAPO's token-level form, summed here; the trainer divides by
the number of tokens in the whole minibatch, over every data-parallel rank):

    ratio   = exp(logp - old)                                  π_θ / π_old (old: the trainer at the rollout's policy)
    pg      = max(-A·ratio, -A·clip(ratio, 1 - clip_low, 1 + clip_high))       PPO's clip, separate low / high
    tis     = min(exp(old - rollout), tis_cap)                 truncated importance weight against the engine's logprob
    loss_t  = tis·pg + kl_coef·k3(logp, ref)                   optional KL to the reference (the base without adapter)

`tis` corrects for the engine sampling from a slightly different distribution than the trainer computes; under
`--deterministic-inference` old == rollout bit for bit and every weight is exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [groups, n] → (r - group mean) / (group std + eps), the std unbiased as in GRPO (n >= 2)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[groups] bool: groups whose rewards differ (DAPO's dynamic filtering: an all-equal group has zero advantage
    everywhere and only dilutes the token mean)."""
    return (rewards != rewards[:, :1]).any(dim=1)


def k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π_θ ‖ π_ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased)."""
    d = ref - logp
    return torch.exp(d) - d - 1


def tis_weights(old: torch.Tensor, rollout: torch.Tensor, cap: float) -> torch.Tensor:
    """Token-level truncated importance weights min(π_old / π_rollout, cap) (no gradient)."""
    return torch.exp(old - rollout).clamp(max=cap).detach()


@dataclass(frozen=True)
class ClipConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0
    kl_coef: float = 0.0


@dataclass
class LossTerms:
    """Per-token sums of one micro-batch (divide by the minibatch's token count for means)."""

    loss: torch.Tensor  # the differentiable sum of loss_t
    tokens: int
    clipped: float  # tokens whose clipped term was taken
    ppo_kl: float  # Σ (old - logp): k1 estimate of KL(π_old ‖ π_θ)
    ref_k3: float  # Σ k3(logp, ref) (0 when no reference)
    tis: float  # Σ tis weights
    tis_truncated: float  # tokens whose weight hit the cap


def policy_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    rollout: torch.Tensor,
    advantages: torch.Tensor,
    cfg: ClipConfig,
    ref: torch.Tensor | None = None,
) -> LossTerms:
    """The summed token loss (module docstring) over flat per-token tensors of one micro-batch."""
    ratio = torch.exp(logp - old)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)
    tis = tis_weights(old, rollout, cfg.tis_cap)
    per_token = tis * pg
    ref_k3 = 0.0
    if ref is not None:
        kl = k3(logp, ref)
        ref_k3 = kl.detach().sum().item()
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * kl
    return LossTerms(
        loss=per_token.sum(),
        tokens=logp.numel(),
        clipped=(clipped > unclipped).sum().item(),
        ppo_kl=(old - logp.detach()).sum().item(),
        ref_k3=ref_k3,
        tis=tis.sum().item(),
        tis_truncated=(torch.exp(old - rollout) > cfg.tis_cap).sum().item(),
    )
