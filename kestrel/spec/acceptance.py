"""Which drafted tokens the target keeps.

A verify block is `[x0, d1 .. d_{n-1}]`; row j of the target's output predicts the token after block token j.

Greedy: keep the longest prefix with d_{j+1} == the target's token at row j, then add the target's token at the
first mismatch (or after the last draft: the bonus token). The committed tokens are exactly what plain greedy
decoding would produce, one step at a time.

Sampled (Leviathan et al. / Chen et al.): keep d_{j+1} with probability min(1, p_j(d)/q_j(d)); at the first
rejection draw from the normalised residual max(0, p_j - q_j); when all are kept draw the bonus from p_{n-1}.
Each committed token is then distributed exactly as a plain sample from p given the tokens before it.
"""

from __future__ import annotations

import torch


def greedy_accept(drafts: list[int], target_tokens: list[int]) -> list[int]:
    """drafts d1..d_{n-1}; target_tokens t_0..t_{n-1} (the target's choice at each block row) → committed."""
    if len(target_tokens) != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} target tokens for {len(drafts)} drafts, got {len(target_tokens)}")
    out = []
    for d, t in zip(drafts, target_tokens):
        out.append(t)
        if d != t:
            return out
    out.append(target_tokens[len(drafts)])
    return out


def sampled_accept(
    drafts: list[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> list[int]:
    """drafts d1..d_{n-1} drawn from draft_probs [n-1, V]; target_probs [n, V] → committed tokens (1..n)."""
    n = len(drafts)
    if target_probs.shape[0] != n + 1 or draft_probs.shape[0] != n:
        raise ValueError(
            f"need {n + 1} target rows and {n} draft rows, got {target_probs.shape[0]}, {draft_probs.shape[0]}"
        )
    device = target_probs.device
    uniforms = torch.rand(n + 1, generator=generator, device=generator.device if generator is not None else device)
    p_draft = target_probs[torch.arange(n, device=device), torch.tensor(drafts, device=device)].tolist()
    q_draft = draft_probs[torch.arange(n, device=device), torch.tensor(drafts, device=device)].tolist()
    out: list[int] = []
    for j, d in enumerate(drafts):
        if q_draft[j] > 0 and uniforms[j].item() * q_draft[j] < p_draft[j]:  # u < p/q without dividing
            out.append(d)
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else target_probs[j]  # p == q: nothing is ever rejected there
        out.append(_draw(dist, uniforms[n].item()))
        return out
    out.append(_draw(target_probs[n], uniforms[n].item()))
    return out


def _draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw with the uniform u in [0, 1): the first index whose cumulative mass exceeds u × total
    (always a token with mass; the last such token if rounding puts u × total past the end)."""
    cdf = probs.double().cumsum(0)
    at = torch.tensor([u * cdf[-1].item()], dtype=torch.float64, device=cdf.device)
    idx = int(torch.searchsorted(cdf, at, right=True))
    return idx if idx < probs.shape[0] else int((probs > 0).nonzero()[-1])
