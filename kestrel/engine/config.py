"""Serving knobs of the engine, validated once at start; `kestrel serve` has one flag per field."""

from __future__ import annotations

from dataclasses import dataclass, field

from kestrel.config import ConfigError
from kestrel.dist.groups import PCP_SPLITS
from kestrel.quant.kv_formats import KV_CACHE_DTYPES

DTYPES = ("float32", "bfloat16", "float16")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SPEC_ALGORITHMS = ("dflash",)
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "fake")


@dataclass
class EngineConfig:
    """Serving knobs; each maps one-to-one onto a CLI flag (SGLang's names where a twin exists)."""

    model: str | None = field(default=None, metadata={"help": "checkpoint folder (default: the built-in model)"})
    dtype: str = field(default="float32", metadata={"help": "weight and activation dtype", "choices": DTYPES})
    device: str = field(default="auto", metadata={"help": "auto (CUDA if available, else CPU), cpu, cuda or cuda:N"})
    page_size: int = field(default=16, metadata={"help": "tokens per KV-cache page"})
    max_total_tokens: int | None = field(
        default=None, metadata={"help": "KV-cache capacity in tokens (default: what --mem-fraction holds)"}
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "MLA/DSA KV cache: auto (model dtype), fp8_e4m3 (FlashMLA layout), nvfp4 (MXFP4 index keys)",
            "choices": KV_CACHE_DTYPES,
        },
    )
    mem_fraction: float = field(
        default=0.5, metadata={"help": "fraction of free device memory (CPU: available RAM) for the caches"}
    )
    max_running_requests: int = field(default=64, metadata={"help": "requests decoded together (KDA state slots)"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "token budget of one engine step"})
    chunked_prefill_size: int = field(default=512, metadata={"help": "prefill chunk in tokens (-1: whole prompt)"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest prompt + output (default: the model's, capped at 32768)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the engine's sampling generators"})
    encoder_cache_tokens: int = field(
        default=16384, metadata={"help": "image feature rows kept for reuse by content hash (vision models)"}
    )
    vision_adapter: bool = field(
        default=True,
        metadata={"help": "run image requests that name no adapter on the checkpoint's vision-lora/ adapter"},
    )
    # Prefix cache (radix tree with KDA state checkpoints) and its lower tiers (HiCache).
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse cached prompt prefixes (radix tree)"})
    state_track_interval: int = field(
        default=256, metadata={"help": "tokens between KDA state checkpoints (a multiple of --page-size)"}
    )
    max_states_per_path: int = field(
        default=-1, metadata={"help": "KDA state checkpoints kept per cached prefix (-1: unlimited)"}
    )
    max_state_checkpoints: int | None = field(
        default=None,
        metadata={"help": "KDA state checkpoints kept in all (default: what --state-checkpoint-memory-ratio holds)"},
    )
    state_checkpoint_memory_ratio: float = field(
        default=0.25,
        metadata={
            "help": "memory for KDA state checkpoints as a fraction of the KV pool's (at least 2 per running request)"
        },
    )
    hicache_size: float = field(default=0.0, metadata={"help": "GB of host memory for evicted pages (0: no host tier)"})
    hicache_storage_dir: str | None = field(
        default=None, metadata={"help": "folder for page files on disk, the third tier (default: none)"}
    )
    hicache_write_policy: str = field(
        default="write_through",
        metadata={"help": "when device pages are copied to the lower tiers", "choices": HICACHE_WRITE_POLICIES},
    )
    # torch intra-op threads on CPU (0: torch's default, all cores; `kestrel serve` leaves one core to HTTP).
    num_threads: int = field(
        default=0, metadata={"help": "torch intra-op threads on CPU (0: torch's default; serve: all cores but one)"}
    )
    # Compiled decode step: torch.compile (inductor) over padded batch-size buckets; CUDA graphs on CUDA.
    compile: bool = field(default=False, metadata={"help": "compile the decode step (CUDA graphs on CUDA)"})
    compile_max_bs: int = field(default=8, metadata={"help": "largest decode batch compiled on CPU"})
    cuda_graph_max_bs: int = field(default=32, metadata={"help": "largest decode batch captured as a CUDA graph"})
    # Speculative decoding (DFlash block drafts).
    speculative_algorithm: str | None = field(
        default=None, metadata={"help": "speculative decoding algorithm (default: none)", "choices": SPEC_ALGORITHMS}
    )
    speculative_draft_model: str | None = field(
        default=None, metadata={"help": "draft checkpoint folder (default: the shipped draft of the embedded model)"}
    )
    speculative_num_draft_tokens: int = field(
        default=7, metadata={"help": "verify block size B: the last token + B-1 drafted tokens"}
    )
    speculative_draft_window_size: int = field(
        default=1024, metadata={"help": "committed tokens the draft's KV keeps per request (sliding window)"}
    )
    enable_linear_replayssm_spec: bool = field(
        default=False, metadata={"help": "KDA rollback by replaying accepted tokens (else per-position snapshots)"}
    )

    # RL rollouts: what each token was routed to, kept beside its KV (prefix-cache hits return full rows), and
    # batch-invariant numerics (a trainer in the same mode recomputes the rollout's logprobs bit for bit).
    enable_return_routed_experts: bool = field(
        default=False, metadata={"help": "record every token's routed experts for /generate's return_routed_experts"}
    )
    enable_return_indexer_topk: bool = field(
        default=False,
        metadata={"help": "record every token's DSA top-k positions for return_indexer_topk (4 B x layers x top-k)"},
    )
    # sglang-router (0.3.2, the newest wheel) re-serializes /generate bodies through a typed struct without the
    # return_routed_experts / return_indexer_topk fields, so a rollout sent through it never asks for capture.
    capture_by_default: bool = field(
        default=False,
        metadata={"help": "every /generate answer carries the enabled capture tables, asked or not (behind a router)"},
    )
    deterministic_inference: bool = field(
        default=False,
        metadata={
            "help": "batch-invariant kernels: rollout logprobs bit-identical to a trainer's in the same mode (slower)",
            "aliases": ["--enable-deterministic-inference"],
        },
    )

    # LoRA serving (kestrel.models.lora): adapters beside the frozen base, chosen per request.
    enable_lora: bool = field(default=False, metadata={"help": "serve LoRA adapters (implied by --lora-paths)"})
    lora_paths: list[str] | None = field(
        default=None,
        metadata={"help": "adapters to load at start, NAME=PATH each (PEFT folders; default: none)", "nargs": "+"},
    )
    max_loras_per_batch: int = field(default=8, metadata={"help": "distinct adapters in one engine step"})
    max_lora_rank: int | None = field(default=None, metadata={"help": "largest adapter rank accepted (default: any)"})

    weight_version: str = field(
        default="default", metadata={"help": "version tag of the loaded weights, reported with every /generate result"}
    )

    # Parallelism (kestrel.dist): one process per rank; rank 0 schedules and samples, the others follow.
    tp: int = field(default=1, metadata={"help": "tensor-parallel ranks", "aliases": ["--tp-size"]})
    ep: int = field(default=1, metadata={"help": "expert-parallel groups within --tp", "aliases": ["--ep-size"]})
    dp_attn: int = field(
        default=1, metadata={"help": "attention data-parallel groups within --tp", "aliases": ["--dp-size"]}
    )
    dcp: int = field(
        default=1,
        metadata={
            "help": "decode context parallelism: MLA/DSA KV sharded by token within --tp",
            "aliases": ["--dcp-size"],
        },
    )
    dcp_interleave: int = field(default=1, metadata={"help": "consecutive tokens kept on one DCP rank"})
    dcp_topk_candidates: int = field(default=384, metadata={"help": "DSA top-k candidates each DCP rank sends first"})
    dcp_merge: str = field(
        default="alltoall",
        metadata={"help": "combining DCP partial attention outputs", "choices": ("alltoall", "allgather")},
    )
    pcp: int = field(
        default=1,
        metadata={
            "help": "prefill context parallelism: long prefills split by token over N copies of the model",
            "aliases": ["--pcp-size"],
        },
    )
    pcp_split: str = field(
        default="zigzag",
        metadata={"help": "prefill tokens to PCP ranks: zigzag (2N blocks) or roundrobin", "choices": PCP_SPLITS},
    )
    pcp_block: int = field(default=64, metadata={"help": "tokens per round-robin PCP block"})
    pp: int = field(default=1, metadata={"help": "pipeline stages (layers split over them)", "aliases": ["--pp-size"]})
    pp_partition: str | None = field(
        default=None,
        metadata={"help": "layers per stage, e.g. 3,1 (default: KESTREL_PP_LAYER_PARTITION, else even)"},
    )
    pp_micro_batches: int = field(default=0, metadata={"help": "micro-batches per step for stage overlap (0: --pp)"})
    enable_dp_attention: bool = field(
        default=False, metadata={"help": "SGLang's switch; --dp-size is then the attention-DP size (as --dp-attn)"}
    )
    moe_dispatch: str = field(
        default="allgather",
        metadata={"help": "MoE token dispatch over expert ranks", "choices": ("allgather", "alltoall")},
    )
    ep_expert_map: str | None = field(
        default=None, metadata={"help": "owner EP rank of each expert, comma-separated (default: equal blocks)"}
    )
    nnodes: int = field(default=1, metadata={"help": "machines the ranks span"})
    node_rank: int = field(default=0, metadata={"help": "this machine's index among --nnodes"})
    dist_init_addr: str | None = field(
        default=None, metadata={"help": "HOST:PORT of node 0's rendezvous (default: a free local port)"}
    )
    dist_timeout: float = field(default=60.0, metadata={"help": "seconds before a stuck collective fails the job"})

    # Prefill/decode disaggregation (kestrel.disagg): SGLang's flags; sglang-router pairs the two roles per request.
    disaggregation_mode: str = field(
        default="null",
        metadata={"help": "null (one worker does both), prefill or decode", "choices": DISAGGREGATION_MODES},
    )
    disaggregation_bootstrap_port: int = field(
        default=8998, metadata={"help": "prefill: port of the bootstrap server decode workers look the rank up at"}
    )
    disaggregation_bootstrap_host: str | None = field(
        default=None, metadata={"help": "address the bootstrap server and the transfer engine use (default: --host)"}
    )
    disaggregation_transfer_backend: str = field(
        default="mooncake",
        metadata={
            "help": "KV transport: mooncake, or fake (instant success, no data: warm-up)",
            "choices": TRANSFER_BACKENDS,
        },
    )
    disaggregation_ib_device: str | None = field(
        default=None, metadata={"help": "RDMA device(s) for Mooncake, e.g. mlx5_0 (default: TCP)"}
    )
    disaggregation_transfer_timeout: float = field(
        default=300.0, metadata={"help": "seconds a request may wait for its KV (either side) before it fails"}
    )

    @property
    def world(self) -> int:
        """Processes the layout runs (one per rank)."""
        return self.tp * self.pcp * self.pp

    def parallel_layout(self):
        """The `kestrel.dist` layout these options ask for."""
        from kestrel.dist.groups import ParallelLayout
        from kestrel.dist.pp import configured_partition

        owners = tuple(int(x) for x in self.ep_expert_map.split(",")) if self.ep_expert_map else None
        return ParallelLayout(
            tp=self.tp,
            ep=self.ep,
            dp_attn=self.dp_attn,
            dcp=self.dcp,
            pcp=self.pcp,
            pp=self.pp,
            expert_map=owners,
            dcp_interleave=self.dcp_interleave,
            dcp_candidates=self.dcp_topk_candidates,
            dcp_merge=self.dcp_merge,
            pcp_split=self.pcp_split,
            pcp_block=self.pcp_block,
            pp_partition=configured_partition(self.pp_partition, self.pp),
            pp_micro_batches=self.pp_micro_batches,
        )

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"engine option {name!r}: {why}")

        need(self.dtype in DTYPES, "dtype", "|".join(DTYPES))
        need(self.page_size >= 1, "page_size", "must be >= 1")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", "|".join(KV_CACHE_DTYPES))
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
        need(self.state_checkpoint_memory_ratio >= 0, "state_checkpoint_memory_ratio", "must be >= 0")
        need(self.encoder_cache_tokens >= 0, "encoder_cache_tokens", "must be >= 0")
        need(self.num_threads >= 0, "num_threads", "must be >= 0 (0: torch's default)")
        need(self.compile_max_bs >= 1, "compile_max_bs", "must be >= 1")
        need(self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs", "must be >= 1")
        need(self.speculative_algorithm in (None, *SPEC_ALGORITHMS), "speculative_algorithm", "|".join(SPEC_ALGORITHMS))
        need(2 <= self.speculative_num_draft_tokens <= 16, "speculative_num_draft_tokens", "must be in [2, 16]")
        need(self.speculative_draft_window_size >= 1, "speculative_draft_window_size", "must be >= 1")
        need(self.hicache_size >= 0, "hicache_size", "must be >= 0 (GB of host memory; 0 = no host tier)")
        for name in ("tp", "ep", "dp_attn", "dcp", "dcp_interleave", "dcp_topk_candidates", "pcp", "pp", "nnodes"):
            need(getattr(self, name) >= 1, name, "must be >= 1")
        need(self.tp % self.dcp == 0, "dcp", f"must divide --tp ({self.tp})")
        need(
            self.page_size % (self.dcp * self.dcp_interleave) == 0,
            "page_size",
            f"must be a multiple of dcp x dcp_interleave ({self.dcp * self.dcp_interleave}): pages split evenly",
        )
        need(0 <= self.node_rank < self.nnodes, "node_rank", "must be in [0, nnodes)")
        need(self.dist_timeout > 0, "dist_timeout", "must be > 0 seconds")
        need(self.moe_dispatch in ("allgather", "alltoall"), "moe_dispatch", "allgather|alltoall")
        need(self.disaggregation_mode in DISAGGREGATION_MODES, "disaggregation_mode", "|".join(DISAGGREGATION_MODES))
        need(
            self.disaggregation_transfer_backend in TRANSFER_BACKENDS,
            "disaggregation_transfer_backend",
            "|".join(TRANSFER_BACKENDS),
        )
        need(0 <= self.disaggregation_bootstrap_port <= 65535, "disaggregation_bootstrap_port", "must be in [0, 65535]")
        need(self.disaggregation_transfer_timeout > 0, "disaggregation_transfer_timeout", "must be > 0 seconds")
        if self.disaggregation_mode != "null":
            # The transfer maps one page table and one state slot per request onto the peer's: one rank each side.
            need(
                self.world == 1 and self.dcp == 1,
                "disaggregation_mode",
                "needs one rank per worker (--tp/--pcp/--pp 1) for now",
            )
            need(self.nnodes == 1, "disaggregation_mode", "needs --nnodes 1 for now")
        if self.ep_expert_map is not None:
            owners = self.ep_expert_map.split(",")
            need(all(x.strip().isdigit() for x in owners), "ep_expert_map", "ints, comma-separated")
        self.parallel_layout().validate()
        if self.lora_paths:
            self.enable_lora = True  # as SGLang: --lora-paths implies --enable-lora
            for entry in self.lora_paths:
                name, sep, path = entry.partition("=")
                need(bool(sep and name and path), "lora_paths", f"NAME=PATH entries, got {entry!r}")
            names = [e.partition("=")[0] for e in self.lora_paths]
            need(len(set(names)) == len(names), "lora_paths", "adapter names must be unique")
        need(self.max_loras_per_batch >= 1, "max_loras_per_batch", "must be >= 1")
        need(self.max_lora_rank is None or self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        if self.speculative_algorithm is not None:
            # Every DFlash step is a verify block that captures target hidden states: none would run compiled.
            need(
                not self.compile,
                "compile",
                "not supported with --speculative-algorithm yet (verify blocks run eagerly)",
            )
        if self.enable_lora:
            need(not self.compile, "compile", "not supported with --enable-lora yet")
            need(self.world == 1, "tp", "--enable-lora needs one process (--tp/--pcp/--pp 1) for now")
        if self.world > 1:
            need(not self.compile, "compile", "not supported with --tp/--pcp/--pp > 1 yet")
            need(
                self.hicache_size == 0 and self.hicache_storage_dir is None,
                "hicache_size",
                "not with --tp/--pcp/--pp > 1 yet",
            )
            need(self.speculative_algorithm is None, "speculative_algorithm", "not with --tp/--pcp/--pp > 1 yet")
        if self.deterministic_inference:
            why = "not supported with --deterministic-inference yet"
            need(not self.compile, "compile", why + " (inductor fuses ops into other reduction orders)")
            need(self.kv_cache_dtype == "auto", "kv_cache_dtype", "must be auto with --deterministic-inference")
            need(self.speculative_algorithm is None, "speculative_algorithm", why)
            need(self.world == 1 and self.nnodes == 1, "tp", why + " (one process: --tp/--pcp/--pp 1)")
        need(
            not self.capture_by_default or self.enable_return_routed_experts or self.enable_return_indexer_topk,
            "capture_by_default",
            "needs --enable-return-routed-experts or --enable-return-indexer-topk",
        )
        if self.enable_return_routed_experts or self.enable_return_indexer_topk:
            need(self.dp_attn == 1 and not self.enable_dp_attention, "dp_attn", "not with rollout capture yet")
            need(self.dcp == 1, "dcp", "not with rollout capture yet")
            need(self.pcp == 1 and self.pp == 1, "pcp" if self.pcp > 1 else "pp", "not with rollout capture yet")
            # A decode worker receives pages, not the prefill worker's records of them.
            need(self.disaggregation_mode == "null", "disaggregation_mode", "not with rollout capture yet")
        need(
            self.hicache_write_policy in HICACHE_WRITE_POLICIES,
            "hicache_write_policy",
            "|".join(HICACHE_WRITE_POLICIES),
        )
