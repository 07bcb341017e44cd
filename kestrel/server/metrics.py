"""Prometheus metrics of one server, in a registry of its own (two apps in one process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    """Gauges are set by the engine thread after every loop; latencies are observed as tokens leave it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("kestrel_num_running_requests", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("kestrel_num_waiting_requests", "Sequences queued for admission", registry=r)
        self.kv_pages_used = Gauge("kestrel_kv_pages_used", "KV cache pages in use", registry=r)
        self.kv_pages_total = Gauge("kestrel_kv_pages_total", "KV cache pages in the pool", registry=r)
        self.state_slots_used = Gauge("kestrel_state_slots_used", "KDA state slots in use", registry=r)
        self.ttft = Histogram(
            "kestrel_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "kestrel_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "kestrel_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("kestrel_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kestrel_generation_tokens", "Generated tokens", registry=r)
        self.cache_queried = Gauge(
            "kestrel_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.cache_hits = Gauge(
            "kestrel_prefix_cache_hit_tokens",
            "Prompt tokens reused from the prefix cache, by tier",
            ["tier"],
            registry=r,
        )
        self.cache_pages = Gauge("kestrel_prefix_cache_pages", "Device KV pages held by the prefix cache", registry=r)
        self.cache_checkpoints = Gauge(
            "kestrel_prefix_cache_checkpoints", "KDA state checkpoints held on the device", registry=r
        )
        self.cache_evicted = Gauge(
            "kestrel_prefix_cache_evicted_pages", "Device KV pages evicted from the prefix cache", registry=r
        )
        self.disk_corrupt = Gauge(
            "kestrel_prefix_cache_disk_corrupt_files", "Disk-tier files that failed verification", registry=r
        )
        self.disk_io_errors = Gauge(
            "kestrel_prefix_cache_disk_io_errors", "Disk-tier OS errors, each treated as a miss", registry=r
        )
        self.disk_written = Gauge("kestrel_hicache_disk_files_written", "Files written to the disk tier", registry=r)
        self.spec_accept_length = Histogram(
            "kestrel_spec_accept_length",
            "Speculative decoding: mean tokens committed per verify block, per finished sequence",
            buckets=(1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 12, 16),
            registry=r,
        )
        self.finished = Counter(
            "kestrel_requests_finished", "Finished sequences by reason", ["finish_reason"], registry=r
        )
        # Prefill/decode disaggregation: what this worker sent (prefill) or received (decode).
        self.transfer_bytes = Counter(
            "kestrel_disagg_transfer_bytes", "KV + state bytes moved by transfers", registry=r
        )
        self.transfer_latency = Histogram(
            "kestrel_disagg_transfer_latency_seconds",
            "Prefill: time to write a request's KV; decode: from registering the room to the KV's arrival",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.transfers_failed = Counter("kestrel_disagg_failed_transfers", "Transfers that failed", registry=r)
        self.transfers_in_flight = Gauge(
            "kestrel_disagg_transfers_in_flight", "Requests whose KV is being moved (or waits to be)", registry=r
        )

    def set_engine_stats(self, stats: dict[str, int]) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_pages_used.set(stats["pages_used"])
        self.kv_pages_total.set(stats["pages_total"])
        self.state_slots_used.set(stats["slots_used"])
        if "prefix_cache_hit_tokens" in stats:
            self.cache_queried.set(stats["prefix_cache_queried_tokens"])
            for tier in ("device", "host", "disk"):
                self.cache_hits.labels(tier=tier).set(stats[f"prefix_cache_{tier}_hit_tokens"])
            self.cache_pages.set(stats["prefix_cache_pages"])
            self.cache_checkpoints.set(stats["prefix_cache_checkpoints"])
            self.cache_evicted.set(stats["prefix_cache_evicted_pages"])
        if "disagg_transferring" in stats:
            self.transfers_in_flight.set(stats.get("disagg_rooms", stats.get("disagg_transfers", 0)))
        if "hicache_disk_files_written" in stats:
            self.disk_corrupt.set(stats["prefix_cache_disk_corrupt_files"])
            self.disk_io_errors.set(stats["prefix_cache_disk_io_errors"])
            self.disk_written.set(stats["hicache_disk_files_written"])

    def observe_transfer(self, record) -> None:
        """One finished `kestrel.disagg.role.TransferRecord`."""
        if record.ok:
            self.transfer_bytes.inc(record.nbytes)
            self.transfer_latency.observe(record.seconds)
        else:
            self.transfers_failed.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
