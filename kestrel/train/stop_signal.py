"""SIGINT / SIGTERM as a request to stop at the next step boundary, so a trainer saves a resumable state, stops the
engine it started and exits 0; a second signal interrupts at once (KeyboardInterrupt)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)


class StopSignal:
    """`installed()` takes over SIGINT and SIGTERM in this process's main thread; `requested` then names the first
    signal that arrived (None until one does)."""

    def __init__(self) -> None:
        self.requested: str | None = None

    def _handle(self, signum: int, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        log.warning("%s: stopping after this step (send it again to stop at once)", self.requested)

    def stop_here(self, step: int) -> bool:
        """A trainer loop's check at a step boundary: True (and logged) once a signal has asked for a stop."""
        if self.requested is not None:
            log.warning("%s: stopping at step %d, saving", self.requested, step)
        return self.requested is not None

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignal]:
        self.requested = None
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals only reach the main thread; whoever owns it decides
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


STOP = StopSignal()  # the process's one: the trainers install it around their loops and read it


def stopped_early() -> bool:
    """A signal ended the last run: its result is a checkpoint to resume, not one to ship (`--ship` says so)."""
    if STOP.requested:
        log.warning("%s ended the run early: not shipping (resume with the same --out, then ship)", STOP.requested)
    return STOP.requested is not None
