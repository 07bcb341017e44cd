"""Turns one decode step's logits into tokens for a batch of requests.

Everything over the vocabulary is batched in torch; the only per-row Python loops gather
parameters/token ids and draw randomness from per-request generators.

Order (vLLM): logprobs from the raw fp32 logits -> min_tokens -> logit_bias -> repetition penalty ->
frequency/presence penalties -> grammar mask (structured output) -> greedy argmax, or temperature -> top-k ->
top-p -> min-p -> sample.

Reproducibility: a seeded row draws exactly one Exp(1) vector of size V from its own generator per
(non-greedy) step and samples with the exponential race argmax(p / q), which is equivalent to sampling
from p. So its tokens do not depend on which other rows share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kestrel.engine.grammar import apply_grammar_masks
from kestrel.engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs about one sequence for this step."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    # Per-request generator (see Sampler.make_generator); None = use the sampler's shared generator.
    generator: torch.Generator | None = None
    # xgrammar GrammarMatcher of a request with a grammar: tokens it rejects next are banned.
    matcher: Any = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # raw logprob of each sampled token
    # Top-N (token, logprob) pairs, best first, for rows with params.logprobs is not None
    # (an empty list when params.logprobs == 0); None for rows that did not ask.
    top_logprobs: list[list[tuple[int, float]] | None]


class PromptLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-k (token, logprob), best first


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _top_logprobs(logprobs: torch.Tensor, ks: list[int | None]) -> list[list[tuple[int, float]] | None]:
    """Top-k (token, logprob) per row with one topk call for the whole batch."""
    kmax = min(max((k for k in ks if k is not None), default=0), logprobs.shape[-1])
    if kmax > 0:
        vals, idx = logprobs.topk(kmax, dim=-1)
        vals_l, idx_l = vals.tolist(), idx.tolist()
    out: list[list[tuple[int, float]] | None] = []
    for i, k in enumerate(ks):
        if k is None:
            out.append(None)
        elif k == 0 or kmax == 0:
            out.append([])
        else:
            out.append(list(zip(idx_l[i][:k], vals_l[i][:k])))
    return out


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int = 0) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.seed = seed
        self._shared: dict[str, torch.Generator] = {}

    def make_generator(self, params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
        """A generator seeded from params.seed (create once per request, reuse every step), or None."""
        if params.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(params.seed)
        return g

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        g = self._shared.get(key)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._shared[key] = g
        return g

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        for r in rows:
            if r.generator is not None and not _same_device(r.generator.device, logits.device):
                raise ValueError(f"generator on {r.generator.device} but logits on {logits.device}")
        batch = len(rows)
        if any(_modifies_logits(r) for r in rows):  # the rules below edit a private fp32 copy in place
            x = logits.to(torch.float32, copy=True)
            raw_logprobs = torch.log_softmax(x, dim=-1)
            self._apply_min_tokens(x, rows)
            _apply_logit_bias(x, rows)
            _apply_penalties(x, rows)
            apply_grammar_masks(x, [r.matcher for r in rows])
        else:  # nothing edits the logits (plain decoding): no copy
            x = logits.float()
            raw_logprobs = torch.log_softmax(x, dim=-1)

        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        rand = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        # max(dim).indices is argmax (the first maximal index, NaN wins) at a third of argmax's cost on CPU
        if not rand:  # all greedy (the common decode batch): no row gather and scatter
            token_ids = x.max(dim=-1).indices
        else:
            token_ids = torch.empty(batch, dtype=torch.long, device=x.device)
        if greedy and rand:
            token_ids[greedy] = x[greedy].max(dim=-1).indices
        if rand:
            token_ids[rand] = self._sample_random(x[rand], [rows[i] for i in rand])

        sampled_logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
        return SamplerOutput(
            token_ids=token_ids.tolist(),
            logprobs=sampled_logprobs.tolist(),
            top_logprobs=_top_logprobs(raw_logprobs, [r.params.logprobs for r in rows]),
        )

    def _apply_min_tokens(self, x: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Mask eos and stop_token_ids so that a request cannot end before min_tokens (in place)."""
        vocab = x.shape[-1]
        row_idx: list[int] = []
        tok_idx: list[int] = []
        for i, r in enumerate(rows):
            if len(r.output_ids) < r.params.min_tokens:
                toks = {t for t in (*self.eos_token_ids, *r.params.stop_token_ids) if 0 <= t < vocab}
                row_idx.extend([i] * len(toks))
                tok_idx.extend(toks)
        if row_idx:
            x[row_idx, tok_idx] = float("-inf")

    def probabilities(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution [B, V] each (non-greedy) row samples from, after every rule above (speculative
        acceptance compares it with the draft's)."""
        x = logits.to(torch.float32, copy=True)
        self._apply_min_tokens(x, rows)
        _apply_logit_bias(x, rows)
        _apply_penalties(x, rows)
        apply_grammar_masks(x, [r.matcher for r in rows])
        return _filtered(x, rows).softmax(dim=-1)

    def _sample_random(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one exponential-race draw per row."""
        device, vocab = x.device, x.shape[-1]
        probs = _filtered(x, rows).softmax(dim=-1)
        q_exp = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            q_exp[shared] = torch.empty(len(shared), vocab, device=device).exponential_(
                generator=self._shared_generator(device)
            )
        for i, r in enumerate(rows):
            if r.generator is not None:
                q_exp[i].exponential_(generator=r.generator)
        # Exp(1) may round to 0; 0/0 would be NaN and win argmax.
        q_exp.clamp_min_(torch.finfo(q_exp.dtype).tiny)
        return (probs / q_exp).argmax(dim=-1)


def _modifies_logits(row: SamplingRow) -> bool:
    """Whether a min_tokens ban, logit_bias, a penalty or a grammar mask edits this row's logits this step."""
    p = row.params
    return (
        len(row.output_ids) < p.min_tokens
        or bool(p.logit_bias)
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
        or row.matcher is not None
    )


def _filtered(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to processed logits (a new tensor)."""
    device, vocab = x.device, x.shape[-1]
    p = [r.params for r in rows]
    x = x / torch.tensor([q.temperature for q in p], device=device)[:, None]

    top_k = [vocab if q.top_k <= 0 else min(q.top_k, vocab) for q in p]
    top_p = [q.top_p for q in p]
    need_k = any(k < vocab for k in top_k)
    need_p = any(tp < 1.0 for tp in top_p)
    if need_k or need_p:
        sorted_x, sorted_idx = x.sort(dim=-1, descending=True)
        if need_k:
            # Value threshold: keeps ties with the k-th logit, independent of sort tie-breaking.
            kth = sorted_x.gather(1, torch.tensor(top_k, device=device)[:, None] - 1)
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if need_p:
            probs = sorted_x.softmax(dim=-1)
            cum = probs.cumsum(dim=-1)
            excl = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
            tp = torch.tensor(top_p, device=device)[:, None]
            # Drop a token once the tokens before it already reach top_p; the top token has excl == 0.
            # Rows with top_p == 1 are skipped so rounding in cumsum can never drop their tail.
            remove = (excl >= tp) & (tp < 1.0)
            sorted_x = sorted_x.masked_fill(remove, float("-inf"))
        x = x.scatter(1, sorted_idx, sorted_x)

    if any(q.min_p > 0 for q in p):
        probs = x.softmax(dim=-1)
        min_p = torch.tensor([q.min_p for q in p], device=device)[:, None]
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return x


def _apply_logit_bias(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Add each row's OpenAI logit_bias to its logits (in place); ids past the vocabulary are the caller's error."""
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if biased:
        row_idx, tok_idx = _flat_indices([(i, list(bias)) for i, bias in biased], x.device)
        values = torch.tensor([v for _, bias in biased for v in bias.values()], dtype=x.dtype, device=x.device)
        x.index_put_((row_idx, tok_idx), values, accumulate=True)


def _apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition penalty over prompt+output, then OpenAI frequency/presence penalties over output (in place)."""
    device = x.device
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = torch.zeros_like(x, dtype=torch.bool)
        row_idx, tok_idx = _flat_indices([(i, rows[i].prompt_ids + rows[i].output_ids) for i in rep], device)
        seen[row_idx, tok_idx] = True
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
        x.copy_(torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x))

    fp = [i for i, r in enumerate(rows) if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
    if fp:
        counts = torch.zeros_like(x)
        row_idx, tok_idx = _flat_indices([(i, rows[i].output_ids) for i in fp], device)
        counts.index_put_((row_idx, tok_idx), torch.ones_like(tok_idx, dtype=x.dtype), accumulate=True)
        freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
        pres = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
        x -= freq * counts + pres * (counts > 0).to(x.dtype)


def _flat_indices(pairs: list[tuple[int, list[int]]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors for scattering each row's token ids into a [B, V] tensor."""
    toks = [t for _, ids in pairs for t in ids]
    rows = [i for i, ids in pairs for _ in ids]
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(toks, dtype=torch.long, device=device),
    )


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], k: int) -> list[PromptLogprob | None]:
    """Logprob of each prompt token given the ones before it, plus the top-k alternatives.

    logits[i] are the model's logits at prompt position i (predicting token i + 1); rows past
    len(prompt_ids) - 1 are ignored. Entry 0 is None: the first token has no context.
    """
    if not prompt_ids:
        return []
    n = len(prompt_ids) - 1
    if logits.dim() != 2 or logits.shape[0] < n:
        raise ValueError(f"need at least {n} rows of logits for {n + 1} prompt tokens, got {tuple(logits.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if n == 0:
        return [None]
    lp = torch.log_softmax(logits[:n].float(), dim=-1)
    targets = torch.tensor(prompt_ids[1:], dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
    tops = _top_logprobs(lp, [k] * n)
    out: list[PromptLogprob | None] = [None]
    out.extend(PromptLogprob(t, c, top or []) for t, c, top in zip(prompt_ids[1:], chosen, tops))
    return out
