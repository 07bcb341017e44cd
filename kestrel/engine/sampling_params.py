"""Per-request sampling parameters (vLLM semantics).

Validated once at construction so the sampler and the detokenizer never have to
re-check user input on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `seed=True` is almost certainly a bug.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop it.

    n > 1 is expanded by the caller into n sequences; the sampler sees one row per sequence.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # a single str is accepted and wrapped
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # eos does not end the request; it does not change sampling
    logprobs: int | None = None  # top-N logprobs per generated token; 0 = only the sampled token's
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (OpenAI)
    # Structured output: an xgrammar CompiledGrammar (`Engine.grammar.compile`, off the engine thread); the
    # output is constrained to it and ends when it is complete. Immutable, so n sequences share it.
    grammar: Any = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self.logit_bias = {} if self.logit_bias is None else dict(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        # Comparisons are written as `not (ok)` so that NaN is rejected too.
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (-2 <= value <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not (0 <= value <= MAX_LOGPROBS)):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain only non-negative ints, got {t!r}")
        for t, bias in self.logit_bias.items():
            if not _is_int(t) or t < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {t!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (-100 <= bias <= 100):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {t}")

    @property
    def is_greedy(self) -> bool:
        """Greedy requests take the argmax; top-k/top-p/min-p and seed are irrelevant for them."""
        return self.temperature < GREEDY_EPS
