"""How big the engine's pools are: KDA state slots from the request limits plus the prefix cache's checkpoints
(a share of the KV memory), KV pages from free memory.

Kept apart from the step loop so the sizing rules (what a slot or a page is reserved for) read in one place; the
planner (`kestrel/plan.py`) predicts the same figures for a deployment."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kestrel.cache.records import record_bytes_per_token
from kestrel.cache.state_pool import state_bytes_per_slot
from kestrel.config import ModelConfig
from kestrel.engine.config import EngineConfig
from kestrel.spec import context_pool

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA) or available RAM (CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


@dataclass(frozen=True)
class PoolSizes:
    """The engine's pools: KDA state slots (of which `checkpoints` are the prefix cache's) and KV pages."""

    num_slots: int
    num_pages: int
    checkpoints: int


def reserved_state_slots(config: EngineConfig, cfg: ModelConfig) -> int:
    """Slots the running requests need: one each, with the prefix cache a tail slot each, and snapshot rollback's
    B-1 per verify block (ReplaySSM needs none)."""
    if not cfg.kda_layers:
        return 0
    spec = 0
    if config.speculative_algorithm and not config.enable_linear_replayssm_spec:
        spec = (config.speculative_num_draft_tokens - 1) * config.max_running_requests
    tails = config.max_running_requests if config.enable_prefix_caching else 0
    return config.max_running_requests + tails + spec


def pool_sizes(
    config: EngineConfig,
    cfg: ModelConfig,
    rank_cfg: ModelConfig,
    device: torch.device,
    kv_bytes_per_token: int,
    max_model_len: int,
) -> PoolSizes:
    """State slots and KV pages together.

    Checkpoints are what lets a later request resume a cached prefix's KDA state, so they are sized by memory, as
    SGLang sizes its mamba pool against the full-attention KV: `state_checkpoint_memory_ratio` of the KV pool's
    bytes (under `mem_fraction` the two share the budget), never fewer than 2 per running request. A fixed
    2 per running request left an `LLM(max_running_requests=1)` 2 checkpoints, evicted before any prompt came back.
    """
    reserved = reserved_state_slots(config, cfg)
    slot_bytes = state_bytes_per_slot(rank_cfg, DTYPES[config.dtype])

    def pages(slots: int, share: float = 1.0) -> int:
        return num_kv_pages(config, cfg, device, kv_bytes_per_token, slots * slot_bytes, max_model_len, share)

    if not cfg.kda_layers or not config.enable_prefix_caching:
        return PoolSizes(reserved, pages(reserved), 0)
    floor = 2 * config.max_running_requests
    if config.max_state_checkpoints is not None:
        checkpoints = config.max_state_checkpoints
        return PoolSizes(reserved + checkpoints, pages(reserved + checkpoints), checkpoints)
    ratio = config.state_checkpoint_memory_ratio
    num_pages = pages(reserved + floor, 1 / (1 + ratio))  # the KV pool's share; checkpoints get the rest
    kv_bytes = num_pages * config.page_size * kv_bytes_per_token
    checkpoints = max(floor, int(ratio * kv_bytes // slot_bytes))
    return PoolSizes(reserved + checkpoints, num_pages, checkpoints)


def num_kv_pages(
    config: EngineConfig,
    cfg: ModelConfig,
    device: torch.device,
    kv_bytes_per_token: int,
    state_bytes: int,
    max_model_len: int,
    share: float = 1.0,
) -> int:
    """KV pages: `max_total_tokens`, or `share` of what `mem_fraction` of free memory holds after `state_bytes` of
    state slots, capped at every running request filling the context. A token's bytes are its KV, its rollout records
    (host memory) and, with DFlash and a prefix cache, its draft context row."""
    if config.max_total_tokens is not None:
        tokens = config.max_total_tokens
    else:
        per_token = max(kv_bytes_per_token, 1)
        if config.speculative_algorithm == "dflash" and config.enable_prefix_caching:
            # the draft's context row kept beside every KV slot (kestrel/spec/context_pool.py); the draft is as wide
            # as the target and in its dtype
            per_token += context_pool.bytes_per_slot(cfg.hidden_size, DTYPES[config.dtype])
        if device.type == "cpu":  # rollout records live in host memory, which is this device's
            per_token += record_bytes_per_token(
                cfg, config.enable_return_routed_experts, config.enable_return_indexer_topk
            )
        budget = (free_memory_bytes(device) * config.mem_fraction - state_bytes) * share
        tokens = int(budget // per_token)
        tokens = min(tokens, config.max_running_requests * max_model_len)
    if tokens < config.page_size:
        raise ValueError(f"KV pool too small: {tokens} tokens (max_total_tokens / mem_fraction)")
    return -(-tokens // config.page_size)
