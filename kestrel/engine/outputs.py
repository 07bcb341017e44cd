"""What the engine hands its callers: per-sequence completions, per-request outputs, and what one step changed.

Plain dataclasses built from finished (or, for streaming, live) `Request`s, so the server, the offline `LLM` and
the RL trainer read results without touching scheduler state."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kestrel.disagg.role import TransferRecord
from kestrel.engine.request import Request


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list | None = None
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # device / host / disk
    error: str | None = None
    error_status: int = 400  # HTTP status of `error` (5xx: a peer worker failed, not the request)
    spec_accept_length: float | None = None  # mean tokens committed per verify block (speculative decoding)
    spec_verify_ct: int = 0  # verify blocks the sequence went through
    # Rollout capture, one row per token that went through the model (prompt + outputs but the last), int32:
    routed_experts: torch.Tensor | None = None  # [tokens, MoE layers, top_k] expert ids
    indexer_topk: torch.Tensor | None = None  # [tokens, DSA layers, index_topk] positions, ascending, -1 padded
    weight_version: str | None = None  # the weights it ran on (None: never scheduled)
    lora_version: str | None = None  # its adapter's version tag and checksum (None: the base, or never scheduled)
    lora_checksum: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list | None = None
    finished: bool = False


@dataclass
class StepResult:
    """What one step changed: requests that got a token or finished (streaming reads their new output) and the
    outputs of request groups that finished."""

    advanced: list[Request] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)
    transfers: list[TransferRecord] = field(default_factory=list)  # KV transfers that ended (disaggregation)


def request_output(group: list[Request]) -> RequestOutput:
    """The output of one request group (its n sequences), finished or a snapshot of a running one."""
    first = group[0]
    out = RequestOutput(first.request_id, first.prompt_ids, finished=all(r.is_finished for r in group))
    out.prompt_logprobs = first.prompt_logprobs if first.params.prompt_logprobs is not None else None
    for i, req in enumerate(group):
        with_lp = req.params.logprobs is not None
        out.outputs.append(
            CompletionOutput(
                index=i,
                text=req.output_text,
                token_ids=list(req.output_ids),
                finish_reason=req.finish_reason,
                logprobs=list(req.logprobs) if with_lp else None,
                top_logprobs=list(req.top_logprobs) if with_lp else None,
                cached_tokens=req.cached_tokens,
                cached_tokens_by_tier=dict(req.cache_hits),
                error=req.error,
                error_status=req.error_status,
                spec_accept_length=req.spec.mean_accept_length if req.spec is not None else None,
                spec_verify_ct=len(req.spec.accept_lengths) if req.spec is not None else 0,
                routed_experts=req.routed_experts,
                indexer_topk=req.indexer_topk,
                weight_version=req.weight_version,
                lora_version=req.lora_version,
                lora_checksum=req.lora_checksum,
            )
        )
    return out
