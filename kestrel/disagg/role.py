"""What both roles share: the request's bootstrap address, the events a role hands the engine each step, and the
one constructor the engine calls.

The engine keeps one step loop for every mode; a role only hooks in at three points: `add` (a new request),
`hand_off` (prefill: the first token is sampled) and `poll` (start of each step: what finished moving).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kestrel.disagg.messages import FirstToken
from kestrel.engine.request import Request

if TYPE_CHECKING:
    from kestrel.disagg.decode import DecodeRole
    from kestrel.disagg.prefill import PrefillRole

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's: a request addressed here takes the fake transfer (health checks, warm-up)
POLL_WAIT_S = 0.002  # how long an idle step waits for a transfer to finish before the engine loop goes round


@dataclass(frozen=True)
class BootstrapTarget:
    """Where a request's prefill rank is (`host:port` of its bootstrap server) and the room pairing both sides."""

    host: str
    port: int
    room: int

    @property
    def fake(self) -> bool:
        return self.host == FAKE_BOOTSTRAP_HOST

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class TransferRecord:
    """One finished transfer, as either side saw it (metrics; tests inspect the pages)."""

    room: int
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""
    pages: list[int] = field(default_factory=list)  # this side's pages of the moved tokens
    slot: int | None = None


@dataclass
class RoleEvents:
    """What one `poll` changed: decode requests that start decoding (with their first token), requests that left
    (prefill: KV delivered; either side: failed), and finished transfers."""

    joined: list[tuple[Request, FirstToken]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    transfers: list[TransferRecord] = field(default_factory=list)


def advertised_host(host: str) -> str:
    """The address peers reach this worker at: `host`, or this machine's name's address for a wildcard bind."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def build_role(engine) -> PrefillRole | DecodeRole:
    """The role of `engine.config.disaggregation_mode`, over the engine's scheduler, pools and speculator."""
    from kestrel.disagg.decode import DecodeRole
    from kestrel.disagg.prefill import PrefillRole

    cls = PrefillRole if engine.config.disaggregation_mode == "prefill" else DecodeRole
    return cls(engine.config, engine.scheduler, engine.runner, engine.spec)
