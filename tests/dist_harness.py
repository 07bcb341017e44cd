"""One spawn helper for multi-process tests: N ranks on this machine over gloo, each with a deadline."""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from kestrel.dist.groups import ParallelLayout
from kestrel.dist.launch import free_port, init_rank, shutdown_rank

RANK_TIMEOUT_S = 60.0  # collectives: a dead or stuck rank fails the others within this


def _entry(rank: int, layout: ParallelLayout, addr: str, fn: Callable, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        groups = init_rank(layout, rank, addr, torch.device("cpu"), RANK_TIMEOUT_S)
        out = fn(groups, *args)
        results.put((rank, "ok", pickle.dumps(out)))  # bytes: tensors copied, not shared with a dying process
    except BaseException:  # report the failure to the parent instead of dying silently
        results.put((rank, "error", traceback.format_exc()))
    finally:
        shutdown_rank()


def spawn_ranks(fn: Callable[..., Any], layout: ParallelLayout, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run `fn(groups, *args)` on every rank of `layout` (one process each); return the results in rank order.

    Raises with the failing rank's traceback, or after `timeout` seconds (every rank is killed first).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_entry, args=(r, layout, addr, fn, args, results)) for r in range(layout.world)]
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # for the children only: 2 cores, up to 4 ranks
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    got: dict[int, Any] = {}
    try:
        while len(got) < layout.world:
            try:
                rank, status, out = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(layout.world)) - set(got))} did not finish") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{out}")
            got[rank] = pickle.loads(out)  # our own child's result (tests only)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(layout.world)]
