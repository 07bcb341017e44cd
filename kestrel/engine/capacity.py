"""How big the engine's pools are: KDA state slots from the request limits, KV pages from free memory.

Kept apart from the step loop so the sizing rules (what a slot or a page is reserved for) read in one place; the
planner (`kestrel/plan.py`) predicts the same figures for a deployment."""

from __future__ import annotations

import os

import torch

from kestrel.cache.records import record_bytes_per_token
from kestrel.cache.state_pool import state_bytes_per_slot
from kestrel.config import ModelConfig
from kestrel.engine.config import EngineConfig

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


def num_state_slots(config: EngineConfig, cfg: ModelConfig) -> int:
    """KDA state slots: one per running request, plus (prefix cache) a tail slot each and checkpoints."""
    if not cfg.kda_layers:
        return 0
    # Snapshot rollback borrows B-1 slots per verify block (ReplaySSM needs none).
    spec = 0
    if config.speculative_algorithm and not config.enable_linear_replayssm_spec:
        spec = (config.speculative_num_draft_tokens - 1) * config.max_running_requests
    if not config.enable_prefix_caching:
        return config.max_running_requests + spec
    checkpoints = config.max_state_checkpoints
    if checkpoints is None:
        checkpoints = 2 * config.max_running_requests
    return 2 * config.max_running_requests + checkpoints + spec


def num_kv_pages(
    config: EngineConfig,
    cfg: ModelConfig,
    rank_cfg: ModelConfig,
    device: torch.device,
    kv_bytes_per_token: int,
    num_slots: int,
    max_model_len: int,
) -> int:
    """KV pages: `max_total_tokens`, or what `mem_fraction` of free memory holds after the state slots (of this
    rank's heads, `rank_cfg`), capped at every running request filling the context."""
    if config.max_total_tokens is not None:
        tokens = config.max_total_tokens
    else:
        per_token = max(kv_bytes_per_token, 1)
        if device.type == "cpu":  # rollout records live in host memory, which is this device's
            per_token += record_bytes_per_token(
                cfg, config.enable_return_routed_experts, config.enable_return_indexer_topk
            )
        budget = free_memory_bytes(device) * config.mem_fraction
        budget -= num_slots * state_bytes_per_slot(rank_cfg, DTYPES[config.dtype])
        tokens = int(budget // per_token)
        tokens = min(tokens, config.max_running_requests * max_model_len)
    if tokens < config.page_size:
        raise ValueError(f"KV pool too small: {tokens} tokens (max_total_tokens / mem_fraction)")
    return -(-tokens // config.page_size)
