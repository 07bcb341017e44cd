"""In-batch prefix sharing: a waiting prompt that starts like one being prefilled waits for that prefill's
checkpoint instead of computing the same tokens beside it.

Without it, the n samples of one prompt (`n > 1`, a GRPO group) are admitted in the same step and each prefills the
whole prompt: the prefix cache only helps requests that arrive after a prefix was committed. SGLang's scheduler
deprioritises such requests the same way (its in-batch prefix check). A request waits only while a partner still
has to compute the shared part, and only when waiting wins at least one page over what the cache holds now; other
requests are admitted past it meanwhile.
"""

from __future__ import annotations

from collections import defaultdict

from kestrel.engine.request import Request

MAX_PARTNERS_PER_KEY = 8  # prefilling requests compared per first page (bounds the work per waiting request)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefillPartners:
    """The requests prefilling this step, indexed by their first page, and what a waiting request could reuse.

    `page_size`, `track_interval`, `has_state` are the prefix cache's: with KDA state a reusable prefix must end at
    a checkpoint, and a prefill leaves one for sure only at interval multiples and at the end of its prompt."""

    def __init__(self, page_size: int, track_interval: int, has_state: bool) -> None:
        self.page_size, self.interval, self.has_state = page_size, track_interval, has_state
        self._by_first_page: dict[tuple[int, ...], list[Request]] = defaultdict(list)

    def add(self, req: Request) -> None:
        """A request that will prefill (admitted, or running with prompt tokens left); decoding ones are skipped
        before their cache key is built (it copies every token)."""
        if not req.in_prefill:
            return
        ids = req.cache_ids
        if len(ids) > self.page_size:
            partners = self._by_first_page[tuple(ids[: self.page_size])]
            partners.append(req)
            del partners[:-MAX_PARTNERS_PER_KEY]

    def _checkpointed(self, partner: Request, limit: int) -> int:
        """The deepest position <= limit where the partner's prefill leaves a reusable prefix."""
        ps = self.page_size
        if not self.has_state:
            return limit // ps * ps  # attention only: every full page is committed
        best = limit // self.interval * self.interval
        end = partner.num_tokens // ps * ps  # its last prefill chunk checkpoints its last page boundary ...
        for pos in (end, end - ps if end == partner.num_tokens else -1):  # ... or one earlier if it ends on one
            if 0 < pos <= limit:
                best = max(best, pos)
        return best

    def reusable_soon(self, req: Request) -> int:
        """How many tokens of `req`'s prompt a partner still prefilling will leave in the cache (0: none)."""
        if not self._by_first_page:
            return 0
        ids = req.cache_ids
        if len(ids) <= self.page_size:
            return 0
        best = 0
        prompt = ids[: len(req.prompt_ids)]
        for partner in self._by_first_page.get(tuple(ids[: self.page_size]), ()):
            limit = min(_common_prefix(prompt, partner.cache_ids), len(prompt) - 1)  # one token is always computed
            target = self._checkpointed(partner, limit)
            if target > partner.computed_len:  # still to be computed: worth waiting for
                best = max(best, target)
        return best
