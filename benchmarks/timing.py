"""The one timer the micro-benchmarks share: a median over calls, so a shared machine's stray slow call drops out."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], calls: int, warmup: int = 0) -> float:
    """Median wall seconds of `calls` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
