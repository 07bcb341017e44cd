"""What the engine thread sends the event loop: per-step deltas of each sequence and the end of each request
(immutable snapshots), and the errors that refuse a request before it reaches the engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kestrel.engine.outputs import RequestOutput


@dataclass
class SeqDelta:
    """New output of one sequence (choice `index` of its request) since the previous event."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finish_reason: str | None = None
    reset: bool = False  # the sequence was retracted: forget what earlier events sent, this one starts over
    weight_version: str | None = None
    lora_version: str | None = None
    lora_checksum: str | None = None


@dataclass
class StreamEvent:
    """What one engine step produced for one request; `output` or `error` ends the stream."""

    request_id: str
    deltas: list[SeqDelta] = field(default_factory=list)
    output: RequestOutput | None = None
    error: str | None = None
    status: int = 400  # HTTP status for `error`: 400 the request was refused, 500 the engine failed

    @property
    def done(self) -> bool:
        return self.output is not None or self.error is not None


class QueueFull(Exception):
    """More requests are queued than --max-queued-requests allows."""


class NeverFits(Exception):
    """A request has more sequences than the running slots and the queue hold together, even on an idle server."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class EngineStopped(Exception):
    """The engine thread has stopped; no more requests are accepted."""


@dataclass
class RequestStream:
    request_id: str
    num_prompt_tokens: int
    queue: asyncio.Queue
