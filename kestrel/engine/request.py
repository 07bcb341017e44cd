"""A request's lifecycle and the invariants of what the caches hold for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kestrel.cache.keys import multimodal_keys
from kestrel.engine.detokenizer import IncrementalDetokenizer
from kestrel.engine.sampler import PromptLogprob
from kestrel.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    Invariants while RUNNING: tokens [0, computed_len) of `all_ids` have their MLA/index keys in `pages`
    and the KDA slot holds the state after token computed_len - 1. Tokens [computed_len, num_tokens) still
    need a forward; when computed_len == num_tokens after a step, the step samples the next token.
    A speculative verify block runs tokens [computed_len, computed_len + n) with n-1 of them drafted (not in
    `output_ids`); after it, computed_len covers only the accepted ones and the slot is rolled back to match.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    computed_len: int = 0
    cached_tokens: int = 0
    # Prefix cache: pages [0, cache_len) belong to the radix tree and are locked through `cache_node`; the
    # rest of `pages` are the request's own. `tail_slot` holds the KDA states at token `tail_len` (the last
    # page boundary reached in decode), committed as a checkpoint when the request finishes.
    cache_node: Any = None
    cache_len: int = 0
    cache_hits: dict[str, int] = field(default_factory=dict)
    tail_slot: int | None = None
    tail_len: int = 0
    num_computed_tokens: int = 0  # tokens this request pushed through the model (prefill + decode)
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None
    error_status: int = 400  # HTTP status of `error`: 400 the request cannot be served, 5xx a peer failed
    generator: torch.Generator | None = None
    matcher: Any = None  # xgrammar GrammarMatcher for params.grammar: it has accepted exactly output_ids
    detokenizer: IncrementalDetokenizer | None = None
    output_text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)
    # Rollout capture (asked for per request, recorded for every token by the engine): read from the rollout
    # records of the request's pages when it finishes, one row per token that went through the model.
    return_routed_experts: bool = False
    return_indexer_topk: bool = False
    routed_experts: torch.Tensor | None = None  # [num_tokens - 1, MoE layers, top_k] int32
    indexer_topk: torch.Tensor | None = None  # [num_tokens - 1, DSA layers, index_topk] int32, -1 padded
    spec: Any = None  # speculative decoding: the request's draft KV and acceptance lengths (kestrel.spec)
    # LoRA adapter by name (None: the base). Its cache keys are the token ids shifted by `cache_key_offset`, so
    # the prefix cache never hands one adapter's KV to another adapter or to the base.
    lora_name: str | None = None
    cache_key_offset: int = 0
    # Prefill/decode disaggregation: the `kestrel.disagg.role.BootstrapTarget` pairing this request with its other
    # half (None: served here from start to end).
    bootstrap: Any = None
    # Images: image i's features replace the prompt's placeholders [image_offsets[i], + images[i].num_tokens).
    # Their prefix-cache keys are the image's content-hash keys (`prompt_keys`), not the placeholder id, so a
    # cached page of one image never serves another.
    images: list[Any] = field(default_factory=list)
    image_offsets: list[int] = field(default_factory=list)
    _prompt_keys: tuple[int, list[int]] | None = field(default=None, repr=False)  # (for cache_key_offset, keys)
    # The weights and adapter version the request runs on, stamped when it is first scheduled (None before). A weight
    # sync never changes them under a running request: it finishes first, or is retracted and restamped on rerun.
    weight_version: str | None = None
    lora_version: str | None = None
    lora_checksum: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """The prefix cache's key of this request's tokens (its adapter's namespace; images by content)."""
        off = self.cache_key_offset
        if self.images:  # computed once per namespace (an adapter swap may move a waiting request's)
            if self._prompt_keys is None or self._prompt_keys[0] != off:
                spans = [(o, im.content_hash, im.num_tokens) for o, im in zip(self.image_offsets, self.images)]
                self._prompt_keys = (off, multimodal_keys(self.prompt_ids, spans, off))
            return self._prompt_keys[1] + (self.output_ids if not off else [t + off for t in self.output_ids])
        ids = self.all_ids
        return ids if not self.cache_key_offset else [t + self.cache_key_offset for t in ids]

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def in_prefill(self) -> bool:
        """Still computing tokens it was given (prompt, or the recompute after a preemption)."""
        return self.num_tokens - self.computed_len > 1 or not self.output_ids
