"""Serving knobs of the engine, validated once at start; `kestrel serve` has one flag per field."""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.config import ConfigError


@dataclass
class EngineConfig:
    """Serving knobs; each maps one-to-one onto a CLI flag (SGLang's names where a twin exists)."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction: float = 0.5
    max_running_requests: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill_size: int = 512
    max_model_len: int | None = None
    seed: int = 0
    # Prefix cache (radix tree with KDA state checkpoints) and its lower tiers (HiCache).
    enable_prefix_caching: bool = True
    state_track_interval: int = 256
    max_states_per_path: int = -1
    max_state_checkpoints: int | None = None
    hicache_size: float = 0.0
    hicache_storage_dir: str | None = None
    hicache_write_policy: str = "write_through"
    # torch intra-op threads on CPU (0: torch's default, all cores; `kestrel serve` leaves one core to HTTP).
    num_threads: int = 0
    # Compiled decode step: torch.compile (inductor) over padded batch-size buckets; CUDA graphs on CUDA.
    compile: bool = False
    compile_max_bs: int = 8
    cuda_graph_max_bs: int = 32

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"engine option {name!r}: {why}")

        need(self.dtype in ("float32", "bfloat16", "float16"), "dtype", "float32|bfloat16|float16")
        need(self.page_size >= 1, "page_size", "must be >= 1")
        need(self.max_total_tokens is None or self.max_total_tokens >= 1, "max_total_tokens", "must be >= 1")
        need(0 < self.mem_fraction <= 1, "mem_fraction", "must be in (0, 1]")
        need(self.max_running_requests >= 1, "max_running_requests", "must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        need(self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1, "chunked_prefill_size", ">= 1 or -1")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        need(
            self.state_track_interval >= self.page_size and self.state_track_interval % self.page_size == 0,
            "state_track_interval",
            f"must be a positive multiple of page_size ({self.page_size})",
        )
        need(self.max_states_per_path >= -1, "max_states_per_path", "must be >= 0, or -1 for unlimited")
        need(self.max_state_checkpoints is None or self.max_state_checkpoints >= 0, "max_state_checkpoints", ">= 0")
        need(self.num_threads >= 0, "num_threads", "must be >= 0 (0: torch's default)")
        need(self.compile_max_bs >= 1, "compile_max_bs", "must be >= 1")
        need(self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs", "must be >= 1")
        need(self.hicache_size >= 0, "hicache_size", "must be >= 0 (GB of host memory; 0 = no host tier)")
        need(
            self.hicache_write_policy in ("write_through", "write_through_selective", "write_back"),
            "hicache_write_policy",
            "write_through|write_through_selective|write_back",
        )
