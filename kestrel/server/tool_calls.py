"""Streaming extraction of Kimi K2 tool calls into OpenAI `tool_calls` deltas.

    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>
    <|tool_calls_section_end|>

A call is announced (index, id, name) once its id is complete; its arguments then stream as they arrive.
Anything that breaks this grammar before a call is announced — a bad id, stray text inside the section, a section
cut off before its first argument — is handed back verbatim as content, so bad model output never fails a request.
A call cut off inside its arguments stays a call (its header and argument text were already streamed; the finish
reason says "length"). Decisions depend only on the text, never on how it was chunked: parsing the whole text at
once yields the concatenation of the streamed deltas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kestrel.chat_template import CALL_ARGS, CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, tool_call_id
from kestrel.server.reasoning import marker_prefix_len

ALL_MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_ARGS, CALL_END)
MAX_ID_CHARS = 256  # an id longer than this is not an id: the section is malformed
_ID = re.compile(r"(?:functions\.)?(?P<name>[^\s:<>|]+?)(?::(?P<idx>\d+))?")

_TEXT, _SECTION, _CALL_ID, _ARGS = "text", "section", "call_id", "args"


@dataclass
class ToolCallDelta:
    """One piece of a streamed call: the header (id and name set, arguments "") or more argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        else:
            out["function"] = {"arguments": self.arguments}
        return out


def _earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else None


class ToolCallParser:
    """Kimi K2 tool-call sections → (content, [ToolCallDelta]) per text delta; see the module docstring."""

    def __init__(self) -> None:
        self._state = _TEXT
        self._buf = ""
        self._raw = ""  # consumed marker text not yet committed to a call; becomes content if the section breaks
        self._num_calls = 0

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Consume one delta; return the content text and call pieces it settles."""
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._buf and self._step(content, calls):
            pass
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of the sequence: settle whatever is held back."""
        content, calls = self.feed("")
        rest, self._buf = self._buf, ""
        if self._state == _ARGS:
            if rest:
                calls.append(ToolCallDelta(self._num_calls - 1, rest))
        elif self._state == _TEXT:
            content += rest
        else:
            content += self._raw + rest
        self._state, self._raw = _TEXT, ""
        return content, calls

    # -- one transition; False = wait for more text ------------------------------------------------------------
    def _step(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        if self._state == _TEXT:
            return self._text(content)
        if self._state == _SECTION:
            return self._section(content)
        if self._state == _CALL_ID:
            return self._call_id(content, calls)
        return self._args(calls)

    def _take(self, n: int) -> str:
        head, self._buf = self._buf[:n], self._buf[n:]
        return head

    def _text(self, content: list[str]) -> bool:
        i = self._buf.find(CALLS_BEGIN)
        if i < 0:
            keep = marker_prefix_len(self._buf, (CALLS_BEGIN,))
            content.append(self._take(len(self._buf) - keep))
            return False
        content.append(self._take(i))
        self._raw = self._take(len(CALLS_BEGIN))
        self._state = _SECTION
        return True

    def _section(self, content: list[str]) -> bool:
        """Between calls: whitespace, then a call or the end of the section."""
        body = self._buf.lstrip()
        if not body:
            return False
        for marker, state in ((CALL_BEGIN, _CALL_ID), (CALLS_END, _TEXT)):
            if body.startswith(marker):
                self._raw += self._take(len(self._buf) - len(body) + len(marker))
                self._state = state
                if state == _TEXT:
                    self._raw = ""
                return True
            if marker.startswith(body):
                return False
        return self._degrade(content)

    def _call_id(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        hit = _earliest(self._buf, ALL_MARKERS)
        if hit is None:
            if len(self._buf) > MAX_ID_CHARS + max(map(len, ALL_MARKERS)):
                return self._degrade(content)
            return False
        i, marker = hit
        match = _ID.fullmatch(self._buf[:i].strip()) if marker == CALL_ARGS and i <= MAX_ID_CHARS else None
        if match is None:
            return self._degrade(content)
        call_id = self._take(i).strip()
        self._take(len(CALL_ARGS))
        name, index = match["name"], self._num_calls
        if call_id != tool_call_id(name, int(match["idx"] or -1)):
            call_id = tool_call_id(name, index)
        calls.append(ToolCallDelta(index, "", call_id, name))
        self._num_calls += 1
        self._state, self._raw = _ARGS, ""
        return True

    def _args(self, calls: list[ToolCallDelta]) -> bool:
        """Argument text until the call ends; a missing `<|tool_call_end|>` is forgiven at the next marker."""
        ends = (CALL_END, CALLS_END, CALL_BEGIN)
        hit = _earliest(self._buf, ends)
        if hit is None:
            text = self._take(len(self._buf) - marker_prefix_len(self._buf, ends))
            if text:
                calls.append(ToolCallDelta(self._num_calls - 1, text))
            return False
        i, marker = hit
        if i:
            calls.append(ToolCallDelta(self._num_calls - 1, self._take(i)))
        self._take(len(marker))
        self._state = {CALL_END: _SECTION, CALLS_END: _TEXT, CALL_BEGIN: _CALL_ID}[marker]
        return True

    def _degrade(self, content: list[str]) -> bool:
        """The section broke the grammar: its uncommitted marker text is content; the rest is reparsed as text."""
        content.append(self._raw)
        self._state, self._raw = _TEXT, ""
        return True


def merge_tool_calls(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """Streamed pieces → complete OpenAI `tool_calls` entries (what a non-streaming response carries)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
        elif d.index in calls:
            calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The whole-text form of `ToolCallParser`: (content, tool_calls)."""
    parser = ToolCallParser()
    c1, d1 = parser.feed(text)
    c2, d2 = parser.finish()
    return c1 + c2, merge_tool_calls(d1 + d2)
