"""The transport: one-sided writes of byte ranges into a peer's registered memory.

`MooncakeBackend` is Mooncake's transfer engine (TCP, or RDMA with an IB device) in P2P-handshake mode: each
worker's engine listens on an RPC port, its session id is `host:port`, and a write names the peer's session and
addresses inside memory the peer registered (the peer's engine refuses anything else). `FakeBackend` moves nothing
and always succeeds: SGLang's warm-up backend.
"""

from __future__ import annotations

import os
import threading
from typing import Protocol

import torch

from kestrel.disagg.layout import Range

MAX_RANGES_PER_BATCH = 1024  # one batch submission; longer lists go in several


class TransferError(RuntimeError):
    """A write did not complete (peer gone, or memory it did not register)."""


class TransferBackend(Protocol):
    session_id: str
    moves_data: bool

    def register(self, tensors: list[torch.Tensor]) -> None: ...
    def unregister(self, tensors: list[torch.Tensor]) -> None: ...
    def write(self, session_id: str, ranges: list[Range]) -> int: ...
    def alive(self, session_id: str) -> bool: ...
    def close(self) -> None: ...


class FakeBackend:
    """Instant success, no data: lets a worker of either role run without a peer (warm-up, health checks)."""

    session_id = "fake"
    moves_data = False

    def register(self, tensors: list[torch.Tensor]) -> None:
        pass

    def unregister(self, tensors: list[torch.Tensor]) -> None:
        pass

    def write(self, session_id: str, ranges: list[Range]) -> int:
        return 0

    def alive(self, session_id: str) -> bool:
        return True

    def close(self) -> None:
        pass


class MooncakeBackend:
    """Mooncake's `TransferEngine`: pools registered once at start, per-request buffers as they come."""

    moves_data = True

    def __init__(self, host: str, ib_device: str | None = None) -> None:
        os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every connection at INFO through glog
        try:
            from mooncake import engine as mooncake_engine
        except ImportError as exc:
            raise RuntimeError(
                "disaggregation_transfer_backend mooncake: the Mooncake transfer engine is not installed "
                f"(pip install -e '.[pd]'; it needs libibverbs1 and libnuma1): {exc}"
            ) from None
        self._cuda = bool(getattr(mooncake_engine, "SUPPORT_CUDA", False))
        self._engine = mooncake_engine.TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, ib_device or "") != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to start on {host} ({protocol})")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: set[int] = set()
        self._lock = threading.Lock()

    def register(self, tensors: list[torch.Tensor]) -> None:
        if not self._cuda and any(t.device.type == "cuda" for t in tensors):
            raise RuntimeError(
                "the installed Mooncake wheel is the CPU build (mooncake-transfer-engine-non-cuda), which cannot "
                "reach pools on CUDA: install mooncake-transfer-engine instead"
            )
        with self._lock:
            for t in tensors:
                if t.data_ptr() in self._registered or t.nbytes == 0:
                    continue
                if self._engine.register_memory(t.data_ptr(), t.nbytes) != 0:
                    raise RuntimeError(f"Mooncake could not register {t.nbytes} bytes at {t.data_ptr():#x}")
                self._registered.add(t.data_ptr())

    def unregister(self, tensors: list[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                if t.data_ptr() in self._registered:
                    self._engine.unregister_memory(t.data_ptr())
                    self._registered.discard(t.data_ptr())

    def write(self, session_id: str, ranges: list[Range]) -> int:
        """Write every range (blocking); the bytes moved. Raises TransferError if any range failed."""
        total = 0
        for i in range(0, len(ranges), MAX_RANGES_PER_BATCH):
            part = ranges[i : i + MAX_RANGES_PER_BATCH]
            src, dst, lengths = (list(x) for x in zip(*part))
            if self._engine.batch_transfer_sync_write(session_id, src, dst, lengths) != 0:
                raise TransferError(f"Mooncake write of {len(part)} ranges to {session_id} failed")
            total += sum(lengths)
        return total

    def alive(self, session_id: str) -> bool:
        """The peer's transfer engine answers its RPC port."""
        return self._engine.send_probe(session_id) == 0

    def close(self) -> None:
        with self._lock:
            for addr in list(self._registered):
                self._engine.unregister_memory(addr)
            self._registered.clear()


def make_backend(name: str, host: str, ib_device: str | None = None) -> TransferBackend:
    return FakeBackend() if name == "fake" else MooncakeBackend(host, ib_device)
