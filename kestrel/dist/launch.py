"""Start the ranks of a parallel layout: spawned on this machine, one process per rank, or under torchrun.

Rank 0 runs `main` (it builds the `Engine`: scheduler, sampling, HTTP); every other rank loads its shard and
follows rank 0's steps. Collectives time out after `dist_timeout` seconds, and on this machine rank 0 watches
its spawned ranks: a rank that dies stops the whole job with an error instead of a hang.
"""

from __future__ import annotations

import _thread
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kestrel.config import ConfigError
from kestrel.dist.groups import Groups, ParallelLayout, build_groups, set_current_groups

log = logging.getLogger(__name__)
T = TypeVar("T")
_FAILED: list[str] = []  # set by rank 0's watcher when a spawned rank exits while the job runs


class RankFailure(RuntimeError):
    """A rank of the job died; every other rank was stopped."""


def job_failed() -> bool:
    return bool(_FAILED)


def fail_job(reason: str) -> None:
    """Rank 0: the job cannot go on (a rank died, a collective failed or timed out): stop as Ctrl-C would."""
    if _FAILED:
        return
    _FAILED.append(reason)
    log.error("%s; stopping every rank", reason)
    _thread.interrupt_main(signal.SIGINT)  # the server shuts down, `generate` unwinds; run_ranks raises RankFailure


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(
    layout: ParallelLayout, rank: int, init_addr: str, device: torch.device, timeout_s: float, local_rank: int = 0
) -> Groups:
    """Join the default process group at tcp://init_addr, then build every axis group."""
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    backend = "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=layout.world, timeout=timeout
    )
    return build_groups(layout, device, timeout)


def shutdown_rank() -> None:
    set_current_groups(None)
    if dist.is_initialized():
        dist.destroy_process_group()


def torchrun_env() -> tuple[int, int, str, int] | None:
    """(rank, world, MASTER_ADDR:MASTER_PORT, local rank) when started by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    addr = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), addr, int(os.environ.get("LOCAL_RANK", 0))


def _follower_entry(index: int, first_rank: int, layout, init_addr, device, timeout_s, follow) -> None:
    """A spawned rank: ignore SIGINT and SIGTERM (a terminal's Ctrl-C reaches every rank; rank 0 stops the others
    with a message, or kills them), join, follow, leave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = first_rank + index
    groups = init_rank(layout, rank, init_addr, device, timeout_s, local_rank=rank % max(1, torch.cuda.device_count()))
    try:
        follow(groups)
    finally:
        shutdown_rank()


def run_ranks(
    layout: ParallelLayout,
    main: Callable[[Groups], T],
    follow: Callable[[Groups], None],
    device: torch.device,
    timeout_s: float = 60.0,
    nnodes: int = 1,
    node_rank: int = 0,
    init_addr: str | None = None,
    followers_finish: bool = False,
) -> T | None:
    """Run rank 0's `main` here and `follow` on every other rank; returns main's result (None off rank 0).

    Under torchrun this process is one rank; otherwise this machine's share of the ranks is spawned, rank 0 (on
    node 0) staying in this process. `followers_finish`: a follower that returns (exit code 0) is done, not dead
    (training, where every rank runs the same loop and may end before rank 0 has saved); serving followers only
    return when rank 0 stops them, so there any exit while the job runs is a failure.
    """
    env = torchrun_env()
    if env is not None:
        rank, world, addr, local_rank = env
        if world != layout.world:
            raise ConfigError(f"torchrun started {world} ranks, the layout needs {layout.world}")
        groups = init_rank(layout, rank, addr, device, timeout_s, local_rank)
        try:
            return main(groups) if rank == 0 else follow(groups)
        except BaseException:
            if not _FAILED:
                raise
        finally:
            shutdown_rank()
        raise RankFailure(f"{_FAILED[0]}; this rank stopped")
    if layout.world % nnodes:
        raise ConfigError(f"nnodes: {layout.world} ranks do not split over {nnodes} nodes")
    if nnodes > 1 and init_addr is None:
        raise ConfigError("dist_init_addr: needed (HOST:PORT of node 0) when nnodes > 1")
    init_addr = init_addr or f"127.0.0.1:{free_port()}"
    per_node = layout.world // nnodes
    first = node_rank * per_node
    spawned = per_node - 1 if node_rank == 0 else per_node
    ctx = mp.start_processes(
        _follower_entry,
        args=(first + (1 if node_rank == 0 else 0), layout, init_addr, device, timeout_s, follow),
        nprocs=spawned,
        join=False,
        start_method="spawn",
    )
    if node_rank != 0:
        ctx.join()
        return None
    stop = threading.Event()
    _FAILED.clear()
    watch_args = (ctx, stop, followers_finish)
    watcher = threading.Thread(target=_watch, args=watch_args, name="kestrel-rank-watch", daemon=True)
    watcher.start()
    try:
        groups = init_rank(layout, 0, init_addr, device, timeout_s)
        result = main(groups)
    except BaseException:
        if not _FAILED:
            raise
    finally:
        stop.set()
        shutdown_rank()
        _join(ctx, timeout_s)
    if _FAILED:
        raise RankFailure(f"{_FAILED[0]}; every rank was stopped")
    return result


def _watch(ctx, stop: threading.Event, clean_exit_ok: bool = False) -> None:
    """Rank 0's watch over its spawned ranks: one that exits while the job runs ends the job with an error (with
    `clean_exit_ok`, one that exits with code 0 has finished)."""
    while not stop.wait(0.2):
        for i, p in enumerate(ctx.processes):
            if p.exitcode is not None and not stop.is_set() and not (clean_exit_ok and p.exitcode == 0):
                for q in ctx.processes:
                    if q.is_alive():
                        q.kill()
                fail_job(f"rank {i + 1} exited with code {p.exitcode}")
                return


def _join(ctx, timeout_s: float) -> None:
    for p in ctx.processes:
        p.join(timeout_s)
        if p.is_alive():
            log.error("rank process %d did not stop within %.0f s; killing it", p.pid, timeout_s)
            p.kill()
            p.join()
