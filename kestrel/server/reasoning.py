"""Streaming split of model text into reasoning (`<think>…</think>`) and the answer.

Fed the text deltas of one sequence in order, the parser returns (reasoning, content) deltas. Text that could
still be the start of a marker is held back until the next delta decides it, so the split never depends on how
the text was chunked: parsing the whole text at once gives the concatenation of the streamed deltas.
"""

from __future__ import annotations

from kestrel.chat_template import THINK_BEGIN, THINK_END


def marker_prefix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ReasoningParser:
    """Kimi reasoning: every `<think>…</think>` section is reasoning, everything else is content.

    Our chat template leaves the model to open the section itself; a template that ends the prompt with
    `<think>` makes the text up to the first `</think>` reasoning too (`think_open=True`). An unclosed section
    (output cut off) stays reasoning; a stray `</think>` outside a section is content.
    """

    def __init__(self, think_open: bool = False) -> None:
        self._in_think = think_open
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Consume one delta; return the (reasoning, content) text it settles."""
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            marker = THINK_END if self._in_think else THINK_BEGIN
            out = reasoning if self._in_think else content
            i = self._buf.find(marker)
            if i >= 0:
                out.append(self._buf[:i])
                self._buf = self._buf[i + len(marker) :]
                self._in_think = not self._in_think
                continue
            keep = marker_prefix_len(self._buf, (marker,))
            out.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of the sequence: a held-back partial marker is plain text of the current section."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self._in_think else ("", rest)


def split_reasoning(text: str, think_open: bool = False) -> tuple[str, str]:
    """The whole-text form of `ReasoningParser` (what a non-streaming response reports)."""
    parser = ReasoningParser(think_open)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2
