"""DFlash speculative decoding inside the engine's step: propose → verify (one target forward) → accept → commit.

Per step: the scheduler gives each decode-ready request a verify chunk of n ≤ B tokens (`block_len`); `propose`
fills it with the draft's n-1 tokens; the model runner runs every chunk in one forward, sampling all rows of a
verify chunk and capturing the draft's target layers; `commit` accepts (greedy or sampled), rolls the KDA states
back to the accepted prefix, frees rejected pages and writes the committed tokens' context into the draft KV.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kestrel.cache.prefix import NoPrefixCache
from kestrel.engine.request import Request
from kestrel.engine.sampler import Sampler, SamplingRow, _top_logprobs
from kestrel.engine.scheduler import ScheduledChunk, SchedulePlan, Scheduler
from kestrel.models.forward_batch import ForwardBatch
from kestrel.spec.acceptance import greedy_accept, sampled_accept
from kestrel.spec.context import DraftKV, gather
from kestrel.spec.context_pool import DraftContextPool
from kestrel.spec.draft import DFlashDraft
from kestrel.spec.rollback import ReplayRollback, SnapshotRollback

log = logging.getLogger(__name__)

# One committed token: (token id, raw logprob, top logprobs or None).
Token = tuple[int, float, list | None]


@dataclass
class SpecState:
    """A request's draft KV and the tokens committed by each of its verify blocks (acceptance lengths)."""

    kv: DraftKV
    accept_lengths: list[int] = field(default_factory=list)

    @property
    def mean_accept_length(self) -> float | None:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else None


class DFlashSpeculator:
    def __init__(
        self,
        draft: DFlashDraft,
        scheduler: Scheduler,
        sampler: Sampler,
        runner,
        block: int,
        window: int,
        replay: bool,
        max_model_len: int,
    ) -> None:
        if block < 2:
            raise ValueError("speculative_num_draft_tokens: must be >= 2")
        self.draft, self.scheduler, self.sampler, self.runner = draft, scheduler, sampler, runner
        self.block, self.window, self.max_model_len = block, window, max_model_len
        target = draft.target
        self.rollback = (
            ReplayRollback(target) if replay else SnapshotRollback(scheduler.cache.alloc_slot, scheduler.slots.free)
        )
        runner.capture_layers = tuple(draft.cfg.target_layer_ids)
        # The context features of every cached token, by KV slot: prefix-cache hits fill the draft KV from here
        # (none without a prefix cache: no request starts past position 0 then).
        self.context_pool: DraftContextPool | None = None
        if not isinstance(scheduler.cache, NoPrefixCache):
            w = draft.fc.weight
            self.context_pool = DraftContextPool(runner.kv_slots, w.shape[0], w.dtype, w.device)
            log.info("DFlash: block %d, draft context pool %.1f MB", block, self.context_pool.nbytes / 2**20)
        runner.replay_verify = replay
        scheduler.spec_block = self.block_len
        self.num_verify_steps = 0
        self.num_committed = 0
        self.accept_hist: dict[int, int] = {}  # tokens committed by a verify block -> how many blocks

    # -- before the forward ------------------------------------------------------------------------------
    def block_len(self, req: Request, budget: int) -> int:
        """Tokens of the request's next verify block (1: decode it plainly this step)."""
        params = req.params
        if req.matcher is not None or req.return_routed_experts or req.return_indexer_topk or req.spec is None:
            return 1
        left = params.max_tokens - len(req.output_ids)
        return max(1, min(self.block, left, budget, self.max_model_len - req.computed_len))

    @torch.inference_mode()
    def propose(self, plan: SchedulePlan) -> None:
        """Fill every verify chunk with the draft's tokens (and their distributions for sampled requests)."""
        chunks = [c for c in plan.chunks if c.verify]
        for c in chunks:
            if not self.rollback.prepare(c):
                c.verify, c.num_tokens = False, 1  # no snapshot slots free: decode it plainly
        if any(not c.verify for c in chunks):
            plan.chunks.sort(key=lambda c: not c.is_decode)
            plan.num_decode = sum(c.is_decode for c in plan.chunks)
        by_len: dict[int, list[ScheduledChunk]] = {}
        for c in chunks:
            if c.verify:
                by_len.setdefault(c.num_tokens, []).append(c)
        device = self.draft.fc.weight.device
        for n, group in by_len.items():
            ctx, mask = gather([c.request.spec.kv for c in group])
            last = torch.tensor([c.request.all_ids[c.start] for c in group], device=device)
            start = torch.tensor([c.start for c in group], device=device)
            logits = self.draft.block_logits(last, start, n, ctx, mask)  # [N, n-1, V]
            for c, row in zip(group, logits):
                params = c.request.params
                if params.is_greedy:
                    c.draft = row.argmax(-1).tolist()
                else:
                    q = torch.softmax(row / params.temperature, dim=-1)
                    gen = c.request.generator or self.sampler._shared_generator(q.device)
                    c.draft = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
                    c.draft_probs = q

    # -- after the forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def commit(self, plan: SchedulePlan, logits: torch.Tensor, batch: ForwardBatch) -> list[list[Token]]:
        """Committed tokens of every sampling chunk (plan order); verify chunks are rolled back and committed."""
        rows, owners = [], []  # sampler rows of plain chunks and greedy verify blocks
        sampled_blocks = []
        offset = 0
        for i, c in enumerate(plan.chunks):
            if not c.samples:
                continue
            req = c.request
            if c.verify and not req.params.is_greedy:
                sampled_blocks.append((i, offset))
            else:
                for j in range(c.num_sampled):
                    out = req.output_ids + c.draft[:j]
                    rows.append(SamplingRow(req.params, req.prompt_ids, out, req.generator, req.matcher))
                    owners.append(offset + j)
            offset += c.num_sampled
        per_row: dict[int, Token] = {}
        if rows:
            got = self.sampler.sample(logits[owners], rows)
            for k, r in enumerate(owners):
                per_row[r] = (got.token_ids[k], got.logprobs[k], got.top_logprobs[k])

        committed: list[list[Token]] = []
        verified: list[tuple[int, ScheduledChunk, int]] = []
        sampled_at = dict(sampled_blocks)
        offset = 0
        for i, c in enumerate(plan.chunks):
            if not c.samples:
                continue
            if not c.verify:
                committed.append([per_row[offset]])
            elif i in sampled_at:
                committed.append(self._sampled_block(c, logits[offset : offset + c.num_tokens]))
            else:
                block = [per_row[offset + j] for j in range(c.num_tokens)]
                keep = greedy_accept(c.draft, [t for t, _, _ in block])
                committed.append(block[: len(keep)])
            if c.verify:
                verified.append((i, c, len(committed[-1])))
            offset += c.num_sampled

        if verified:
            self.rollback.commit(self.runner.states, verified, batch)
            for _, c, accepted in verified:
                self.scheduler.commit_verify(c, accepted)
                c.request.spec.accept_lengths.append(accepted)
                self.num_verify_steps += 1
                self.num_committed += accepted
                self.accept_hist[accepted] = self.accept_hist.get(accepted, 0) + 1
        self._extend_context(plan, batch, {i: accepted for i, _, accepted in verified})
        return committed

    def _sampled_block(self, c: ScheduledChunk, logits: torch.Tensor) -> list[Token]:
        req = c.request
        rows = [SamplingRow(req.params, req.prompt_ids, req.output_ids + c.draft[:j]) for j in range(c.num_tokens)]
        probs = self.sampler.probabilities(logits, rows)
        gen = req.generator or self.sampler._shared_generator(logits.device)
        tokens = sampled_accept(c.draft, probs, c.draft_probs.to(probs.dtype), gen)
        raw = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
        chosen = raw.gather(1, torch.tensor(tokens, device=raw.device)[:, None]).squeeze(1).tolist()
        tops = _top_logprobs(raw, [req.params.logprobs] * len(tokens))
        return list(zip(tokens, chosen, tops))

    def _extend_context(self, plan: SchedulePlan, batch: ForwardBatch, accepted: dict[int, int]) -> None:
        """Write the committed tokens' context features into each request's draft KV (allocated on first use)."""
        if not batch.captured:
            return
        seqs, rows = [], []
        for i, c in enumerate(plan.chunks):
            sl = batch.seq_slice(i)
            n = accepted.get(i, c.num_tokens)
            seqs.append((c, n))
            rows.extend(range(sl.start, sl.start + n))
        pick = _row_picker(rows, batch.input_ids.device)
        feats = self.draft.context({k: pick(h) for k, h in batch.captured.items()})
        positions = pick(batch.positions)
        if self.context_pool is not None:
            self.context_pool.write(pick(batch.cache.write_slots), pick(batch.input_ids), positions, feats)
        kv = self.draft.context_kv(feats, positions)
        at = 0
        for c, n in seqs:
            req = c.request
            if req.spec is None:
                req.spec = SpecState(self._new_kv(req))
                if c.start and self.context_pool is not None:  # a prefix-cache hit: the cached tokens' context
                    self._cached_context(req, c.start)
            sl = slice(at, at + n)
            req.spec.kv.write(positions[sl], [(k[sl], v[sl]) for k, v in kv])
            at += n

    def _cached_context(self, req: Request, cached: int) -> None:
        """Write the draft keys/values of the request's first `cached` tokens (not computed by its own forwards)
        from the context pool rows of their KV slots; rows written for other tokens stay holes."""
        device, ps = self.context_pool.feats.device, self.scheduler.pages.page_size
        positions = torch.arange(cached, device=device)
        pages = torch.tensor(req.pages[: -(-cached // ps)], dtype=torch.long, device=device)
        slots = pages[positions // ps] * ps + positions % ps
        tokens = torch.tensor(req.all_ids[:cached], dtype=torch.long, device=device)
        feats, positions = self.context_pool.read(slots, tokens, positions)
        if len(positions):
            req.spec.kv.write(positions, self.draft.context_kv(feats, positions))

    def attach_context(self, req: Request) -> DraftKV:
        """Give a request its (empty) draft KV now rather than at its first forward: a decode worker of a
        disaggregated pair receives the prompt's context into it."""
        req.spec = SpecState(self._new_kv(req))
        return req.spec.kv

    def _new_kv(self, req: Request) -> DraftKV:
        attn = self.draft.layers[0].self_attn
        need = len(req.prompt_ids) + req.params.max_tokens
        capacity = min(self.window, -(-need // 64) * 64)
        w = self.draft.fc.weight
        return DraftKV(
            capacity,
            len(self.draft.layers),
            attn.n_heads,
            attn.nope + attn.rope_dim,
            attn.v_dim,
            w.dtype,
            w.device,
        )

    def stats(self) -> dict[str, float]:
        steps = self.num_verify_steps
        return {
            "spec_verify_steps": steps,
            "spec_committed_tokens": self.num_committed,
            "spec_accept_length": self.num_committed / steps if steps else 0.0,
        }


def _row_picker(rows: list[int], device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function taking these rows (ascending) of a tensor: a view when they are one run (a lone request's block),
    else one `index_select` (CPU advanced indexing copies element by element)."""
    if rows and rows[-1] - rows[0] == len(rows) - 1:
        run = slice(rows[0], rows[-1] + 1)
        return lambda t: t[run]
    index = torch.tensor(rows, dtype=torch.long, device=device)
    return lambda t: t.index_select(0, index)
