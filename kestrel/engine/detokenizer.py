"""Incremental detokenization with stop-string handling.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte UTF-8 character can be
split across tokens, and some decoders need left context. So, as in vLLM, we decode a small window
`ids[prefix_offset:]` and emit only what it adds beyond `ids[prefix_offset:read_offset]`, holding
everything back while the window still ends in U+FFFD (an incomplete character).

Stop strings: text that could still be the start of a stop string is held back until it is
disambiguated, so a stop string split across tokens never leaks a partial prefix to the client.
"""

from __future__ import annotations

from tokenizers import Tokenizer

# Prompt tokens kept as left context for decoding the first generated tokens.
CONTEXT_WINDOW = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams one request's output text; feed it every generated token id with push()."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = list(stop or [])
        if any(not s for s in self._stop):
            raise ValueError("stop strings must be non-empty")
        self._include_stop = include_stop_str_in_output
        # ids[:read_offset] has been decoded; ids[prefix_offset:read_offset] is the decoding context.
        self._ids: list[int] = list(prompt_ids[-CONTEXT_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""  # emitted
        self._pending = ""  # decoded but held back (possible stop-string prefix)
        self._stopped = False
        self._stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of push() and flush() results)."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended generation, if any."""
        return self._stop_reason

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly finalised text ("" while held back or after a stop)."""
        if self._stopped:
            return ""
        self._ids.append(token_id)
        return self._accept(self._decode_new(final=False))

    def flush(self) -> str:
        """End of generation (eos / length): release held-back text, including an incomplete last character."""
        if self._stopped:
            return ""
        delta = self._accept(self._decode_new(final=True))
        if not self._stopped:
            delta += self._pending
            self._text += self._pending
            self._pending = ""
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, final: bool) -> str:
        """Text added by ids[read_offset:], or "" while it ends in an incomplete character (unless final)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _accept(self, delta: str) -> str:
        """Append decoded text, apply stop strings, and return what can be emitted now."""
        if not delta:
            return ""
        pending = self._pending + delta
        if not self._stop:
            self._text += pending
            self._pending = ""
            return pending
        # A stop string can only start inside pending: emitted text never ends in a stop-string prefix.
        match = self._find_stop(pending)
        if match is not None:
            start, stop = match
            out = pending[: start + len(stop)] if self._include_stop else pending[:start]
            self._text += out
            self._pending = ""
            self._stopped = True
            self._stop_reason = stop
            return out
        hold = self._held_suffix_len(pending)
        out = pending[: len(pending) - hold]
        self._pending = pending[len(pending) - hold :]
        self._text += out
        return out

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that completes first when streaming text (earliest end; then the longest)."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
