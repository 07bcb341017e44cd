"""What the two roles say to each other: JSON bodies of the control plane, and the aux row the prefill writes last.

Nothing from the network is unpickled: control messages are JSON validated here (strict types, bounded lists), and
the aux row is a fixed array of int64 words. The aux row is the decode side's mailbox for one transfer: the
prefill writes the payload (first token, its logprobs, cached tokens, an error text) with the data, and then, in a
write of its own, the room id and the status word, so a status the decode reads is never ahead of the bytes.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from kestrel.engine.sampling_params import MAX_LOGPROBS

MAX_PAGES = 1 << 20  # a room's destination pages (16M tokens at page size 16)
ERROR_BYTES = 256


class TransferState(enum.IntEnum):
    """A request's transfer, on either side (SGLang's KVPoll states)."""

    BOOTSTRAPPING = 1  # prefill: no destination yet; decode: looking the prefill rank up / registering the room
    WAITING = 2  # prefill: destination known, prompt still computing; decode: registered, no data yet
    TRANSFERRING = 3  # the prefill is writing
    SUCCESS = 4
    FAILED = 5


# -- control plane (decode → prefill, HTTP JSON) ----------------------------------------------------------------
class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegionMsg(_Msg):
    addr: StrictInt = Field(ge=0)
    row_bytes: StrictInt = Field(ge=1)
    rows: StrictInt = Field(ge=1)


class LayoutMsg(_Msg):
    page_size: StrictInt = Field(ge=1)
    kv: list[RegionMsg] = Field(max_length=4096)
    state: list[RegionMsg] = Field(max_length=4096)


class ConnectMsg(_Msg):
    """A decode worker introduces itself: its transfer session and where its pools and aux rows live."""

    instance_id: StrictStr = Field(min_length=1, max_length=64)
    session_id: StrictStr = Field(min_length=1, max_length=256)
    layout: LayoutMsg
    aux: RegionMsg


class DraftMsg(_Msg):
    capacity: StrictInt = Field(ge=1)
    k: RegionMsg
    v: RegionMsg
    valid: RegionMsg


class RoomMsg(_Msg):
    """One request's destination: pages for prompt tokens [prefix_len, prompt_len), a state slot, an aux row."""

    instance_id: StrictStr = Field(min_length=1, max_length=64)
    room: StrictInt = Field(ge=0, lt=1 << 63)
    prompt_len: StrictInt = Field(ge=1)
    prompt_digest: StrictStr = Field(min_length=1, max_length=128)
    prefix_len: StrictInt = Field(ge=0)
    pages: list[StrictInt] = Field(max_length=MAX_PAGES)
    slot: StrictInt | None = Field(default=None, ge=0)
    aux_index: StrictInt = Field(ge=0)
    draft: DraftMsg | None = None


class AbortMsg(_Msg):
    instance_id: StrictStr = Field(min_length=1, max_length=64)
    room: StrictInt = Field(ge=0, lt=1 << 63)


def prompt_digest(ids: list[int]) -> str:
    """Both sides must have tokenized the same prompt (same template, same tokenizer)."""
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:32]


# -- the aux row ----------------------------------------------------------------------------------------------
@dataclass
class FirstToken:
    """What the prefill sampled, for the decode side's first output."""

    token: int = 0
    logprob: float = 0.0
    top: list[tuple[int, float]] | None = None
    cached_tokens: int = 0  # prompt tokens the prefill reused from its prefix cache


@dataclass
class AuxRow:
    """Layout of one row (int64 words): [room, status | token, logprob, cached, n_top, (id, logprob) × 20 |
    error length, error text]. Words 0-1 are the final write."""

    first: FirstToken = field(default_factory=FirstToken)
    error: str = ""

    HEAD = 2
    TOP = 4 + 2 * MAX_LOGPROBS
    WORDS = HEAD + TOP + 1 + ERROR_BYTES // 8

    def payload(self) -> np.ndarray:
        """Words [HEAD, WORDS): everything but room and status."""
        out = np.zeros(self.WORDS - self.HEAD, dtype=np.int64)
        f = self.first
        top = (f.top or [])[:MAX_LOGPROBS]
        out[0], out[1], out[2] = f.token, _bits(f.logprob), f.cached_tokens
        out[3] = len(top) if f.top is not None else -1
        for i, (tid, lp) in enumerate(top):
            out[4 + 2 * i], out[5 + 2 * i] = tid, _bits(lp)
        text = self.error.encode()[:ERROR_BYTES]
        out[self.TOP] = len(text)
        raw = np.frombuffer(text.ljust(ERROR_BYTES, b"\0"), dtype=np.int64)
        out[self.TOP + 1 :] = raw
        return out

    @classmethod
    def read(cls, row: np.ndarray) -> AuxRow:
        p = row[cls.HEAD :]
        n_top = int(p[3])
        top = None if n_top < 0 else [(int(p[4 + 2 * i]), _float(p[5 + 2 * i])) for i in range(n_top)]
        first = FirstToken(int(p[0]), _float(p[1]), top, int(p[2]))
        n = int(p[cls.TOP])
        error = p[cls.TOP + 1 :].tobytes()[:n].decode(errors="replace")
        return cls(first, error)


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _float(bits) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]
