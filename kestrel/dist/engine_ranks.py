"""The engine over a parallel layout: rank 0 builds the `Engine`, every other rank follows its steps."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from kestrel.config import ConfigError
from kestrel.dist.groups import Groups, current_groups
from kestrel.dist.launch import run_ranks

T = TypeVar("T")


def engine_groups(config) -> Groups | None:
    """The running layout's groups for an Engine (None for one process); the layout must be the configured one."""
    layout = config.parallel_layout()
    groups = current_groups()
    if layout.world == 1:
        return None
    if groups is None:
        raise ConfigError(
            f"tp: {layout.world} ranks need one process each; start them with `kestrel serve|generate --tp N`, "
            "torchrun, or kestrel.dist.engine_ranks.run_engine"
        )
    if groups.layout != layout:
        raise ConfigError(f"tp/ep/dp_attn: the engine asks for {layout}, the processes were started as {groups.layout}")
    return groups


def follow_engine(config, groups: Groups) -> None:
    """Ranks > 0: load this rank's shard, size the pools as rank 0 says, then run its steps until it stops."""
    from kestrel.dist.runner import DistModelRunner
    from kestrel.dist.tensor_parallel import load_sharded_model
    from kestrel.engine.capacity import DTYPES, resolve_device
    from kestrel.models.builtin import builtin_model_path

    device = resolve_device(config.device)
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # as the Engine does: the same numbers on every rank
        # Default: this machine's cores shared among its ranks (torch's default would give each rank all of them).
        per_node = groups.layout.world // config.nnodes
        torch.set_num_threads(config.num_threads or max(1, len(os.sched_getaffinity(0)) // per_node))
    path = Path(config.model) if config.model else builtin_model_path()
    model, _ = load_sharded_model(path, groups, DTYPES[config.dtype], device, config.moe_dispatch)
    DistModelRunner.follower(model, DTYPES[config.dtype], groups, config.kv_cache_dtype).follow()


def _lead(main: Callable[[], T], groups: Groups) -> T:
    """Rank 0: run main (it builds the Engine), then release the followers whatever happened."""
    from kestrel.dist.runner import release_followers

    try:
        return main()
    finally:
        release_followers()


def run_engine(config, main: Callable[[], T]) -> T | None:
    """Run `main` (which builds an `Engine(config)`) as rank 0 of the configured layout, the other ranks following.

    One process: just `main()`. Returns main's result on rank 0 and None on the ranks of other nodes.
    """
    layout = config.parallel_layout()
    if layout.world == 1:
        return main()
    from kestrel.config import load_model_config
    from kestrel.engine.capacity import resolve_device
    from kestrel.models.builtin import builtin_model_path

    layout.validate(load_model_config(config.model or builtin_model_path()))  # one clear error before any spawn

    return run_ranks(
        layout,
        functools.partial(_lead, main),
        functools.partial(follow_engine, config),
        resolve_device(config.device),
        config.dist_timeout,
        config.nnodes,
        config.node_rank,
        config.dist_init_addr,
    )
