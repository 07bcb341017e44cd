"""Structured output with xgrammar: grammars compiled per request, one token mask per step for all rows.

Compiling a grammar takes milliseconds to seconds, so the HTTP layer does it on a worker thread
(`GrammarBackend.compile`) and hands the engine the compiled grammar inside `SamplingParams`; the engine
gives each sequence its own `GrammarMatcher`, and the sampler masks every constrained row with one bitmask.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

import torch

from kestrel.chat_template import CALL_ARGS, CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, tool_call_id

if TYPE_CHECKING:
    import xgrammar
    from xgrammar import CompiledGrammar, GrammarMatcher
COMPILER_CACHE_BYTES = 256 << 20  # compiled grammars kept for requests that repeat a schema
# Longest run of whitespace between JSON tokens: unbounded, a weak model can indent forever (kestrel-mini did).
MAX_WHITESPACE_RUN = 16


@functools.cache
def _xgr() -> xgrammar:
    """xgrammar, imported on first use: importing it (triton, transformers) took ~2.4 s of every server start."""
    import xgrammar

    return xgrammar


def new_matcher(grammar: CompiledGrammar) -> GrammarMatcher:
    """A fresh matcher of one sequence: it has accepted no token yet."""
    return _xgr().GrammarMatcher(grammar)


def tokenizer_info(tokenizer, vocab_size: int, eos_token_ids: list[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of a `tokenizers.Tokenizer`, sized to the model's logits: ids the tokenizer lacks (padded
    embedding rows) are never allowed, and tokenizer ids the model cannot emit are dropped."""
    from transformers import PreTrainedTokenizerFast  # a dependency of xgrammar; only its vocabulary is read

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    return _xgr().TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))


class GrammarBackend:
    """One compiler (and its cache) per engine; `compile` is thread-safe and meant for a worker thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size, eos_token_ids)
        self.compiler = _xgr().GrammarCompiler(self.info, cache_limit_bytes=COMPILER_CACHE_BYTES)

    def compile(self, kind: str, schema: dict[str, Any] | None = None, strict: bool = True) -> CompiledGrammar:
        """`json_object`: any JSON object; `json_schema`: JSON matching `schema`. Raises ValueError if the schema
        is not one xgrammar can compile."""
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', max_whitespace_cnt=MAX_WHITESPACE_RUN)
        if kind != "json_schema":
            raise ValueError(f"no grammar for response_format type {kind!r}")
        try:
            return self.compiler.compile_json_schema(
                json.dumps(schema), strict_mode=strict, max_whitespace_cnt=MAX_WHITESPACE_RUN
            )
        except RuntimeError as exc:
            raise ValueError(f"invalid JSON schema: {_reason(exc)}") from None

    def compile_tool_calls(self, tools: list[dict[str, Any]], parallel: bool = True) -> CompiledGrammar:
        """A Kimi K2 tool-call section (`kestrel.server.tool_calls`) and nothing else: one or more calls (exactly
        one unless `parallel`) to the given tools, each with arguments matching its `parameters` schema. The
        section markers are single tokens of the tokenizer, so the grammar takes them only as those tokens."""
        st = _xgr().structural_tag
        calls = [
            st.SequenceFormat(
                elements=[
                    st.TokenFormat(token=CALL_BEGIN),
                    # The id is `functions.NAME:INDEX`; the index is free (the parser numbers calls itself).
                    st.ConstStringFormat(value=tool_call_id(t["function"]["name"], 0)[:-1]),
                    st.RegexFormat(pattern=r"[0-9]{1,3}"),
                    st.TokenFormat(token=CALL_ARGS),
                    st.JSONSchemaFormat(
                        json_schema=t["function"].get("parameters") or {"type": "object"},
                        max_whitespace_cnt=MAX_WHITESPACE_RUN,
                    ),
                    st.TokenFormat(token=CALL_END),
                ]
            )
            for t in tools
        ]
        call = calls[0] if len(calls) == 1 else st.OrFormat(elements=calls)
        section = st.SequenceFormat(
            elements=[
                st.TokenFormat(token=CALLS_BEGIN),
                st.PlusFormat(content=call) if parallel else call,
                st.TokenFormat(token=CALLS_END),
            ]
        )
        try:
            return self.compiler.compile_structural_tag(st.StructuralTag(format=section))
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"invalid parameters schema: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    # xgrammar prefixes its C++ location ("[12:00:00] /project/cpp/...cc:42: "); keep the reason.
    return str(exc).strip().rsplit(": ", 1)[-1] if ".cc:" in str(exc) else str(exc).strip()


def apply_grammar_masks(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> None:
    """Ban, in place, every token the row's matcher would reject next; rows without a matcher are untouched."""
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return
    # The bitmask spans the model's vocabulary (`tokenizer_info`), which is the logits' width.
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    for j, i in enumerate(rows):
        matchers[i].fill_next_token_bitmask(bitmask, j)
    # xgrammar's CPU kernel on a copy of just the constrained rows: on CUDA that is one small transfer each way.
    sub = logits[rows].cpu()
    xgr.apply_token_bitmask_inplace(sub, bitmask)
    logits[rows] = sub.to(logits.device)
