"""The step loop: schedule → one forward for every running request → sample → advance → outputs.

The engine owns what sampled tokens mean: appending them (and logprobs), detokenizing, the stop rules and the
output objects; the scheduler only learns which requests finished."""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import uuid
from pathlib import Path

import torch

from kestrel.cache.hicache import HiCache
from kestrel.cache.kv_pool import PageAllocator, kv_bytes_per_token
from kestrel.cache.prefix import NoPrefixCache
from kestrel.cache.radix import RadixCache
from kestrel.cache.state_pool import SlotAllocator
from kestrel.disagg.messages import FirstToken
from kestrel.disagg.role import BootstrapTarget, TransferRecord, build_role
from kestrel.dist.dp_scheduler import dp_scheduling
from kestrel.dist.engine_ranks import engine_groups
from kestrel.dist.pp import stage_configs
from kestrel.dist.runner import DistModelRunner
from kestrel.dist.tensor_parallel import load_sharded_model
from kestrel.engine.capacity import DTYPES, pool_sizes, resolve_device
from kestrel.engine.config import EngineConfig
from kestrel.engine.detokenizer import IncrementalDetokenizer
from kestrel.engine.encoder_cache import EncoderCache
from kestrel.engine.grammar import GrammarBackend, new_matcher
from kestrel.engine.lora_registry import AdapterRegistry, AdapterVersion, started
from kestrel.engine.model_runner import ModelRunner
from kestrel.engine.outputs import RequestOutput, StepResult, request_output
from kestrel.engine.request import Request
from kestrel.engine.sampler import Sampler, SamplingRow, prompt_logprobs
from kestrel.engine.sampling_params import SamplingParams
from kestrel.engine.scheduler import SchedulePlan, Scheduler
from kestrel.engine.stop_rules import stop_reason
from kestrel.engine.vision_adapter import VISION_ADAPTER, vision_adapter_dir
from kestrel.engine.weight_sync import reload_weights, restart
from kestrel.models.builtin import builtin_model_path
from kestrel.models.layers import cpu_kernels
from kestrel.models.loader import load_model
from kestrel.models.lora import LoRAManager
from kestrel.models.vision.inputs import image_offsets
from kestrel.models.vision.preprocess import ProcessedImage
from kestrel.spec.draft import load_spec_draft
from kestrel.spec.speculator import DFlashSpeculator
from kestrel.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 32768


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            # Decaying KDA states and masked softmax tails reach subnormal floats, which x86 CPUs compute
            # ~100x slower; flushing them to zero changes nothing above 1e-38 and made decode 12x faster.
            torch.set_flush_denormal(True)
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
        path = Path(config.model) if config.model else builtin_model_path()
        self.groups = engine_groups(config)
        if self.groups is None:
            self.model, self.model_config = load_model(path, DTYPES[config.dtype], self.device)
        else:  # this rank's shard; `model.cfg` is the rank's view (its heads), `model_config` the whole model's
            self.model, self.model_config = load_sharded_model(
                path, self.groups, DTYPES[config.dtype], self.device, config.moe_dispatch
            )
        if config.deterministic_inference:
            if self.model_config.routed_expert_format == "mxfp4":
                raise ValueError("deterministic_inference: not supported with MXFP4-packed experts yet")
            self.model.batch_invariant = True
        self.tokenizer = load_tokenizer(path)
        cfg = self.model_config
        if self.device.type == "cpu":
            cpu_kernels.module()  # build (once per environment) or load the compiled CPU kernels now, not in a request
        self.max_model_len = config.max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        # Per rank: DCP shards every page's tokens; pipeline stages hold their layers' pools only (the fullest one
        # bounds the pool every stage allocates).
        views = [cfg] if self.groups is None else stage_configs(cfg, self.groups.layout)
        kv_dtype, kv_format = DTYPES[config.dtype], config.kv_cache_dtype
        self.kv_bytes_per_token = max(kv_bytes_per_token(v, kv_dtype, kv_format) for v in views) // config.dcp
        sizes = pool_sizes(config, cfg, self.model.cfg, self.device, self.kv_bytes_per_token, self.max_model_len)
        num_slots, num_pages = sizes.num_slots, sizes.num_pages
        self.pages = PageAllocator(num_pages, config.page_size)
        self.slots = SlotAllocator(num_slots)  # no slots for models without KDA layers
        compile_max_bs = 0
        if config.compile:
            compile_max_bs = config.cuda_graph_max_bs if self.device.type == "cuda" else config.compile_max_bs
        pools = (self.model, num_pages, config.page_size, max(num_slots, 1), DTYPES[config.dtype])
        if self.groups is None:
            self.runner = ModelRunner(*pools, compile_max_bs, config.kv_cache_dtype)
        else:
            self.runner = DistModelRunner(*pools, self.groups, config.kv_cache_dtype)
        if self.model.has_vision:
            self.runner.encoder_cache = EncoderCache(self.model, config.encoder_cache_tokens)
        if config.enable_return_routed_experts or config.enable_return_indexer_topk:
            self.runner.enable_records(config.enable_return_routed_experts, config.enable_return_indexer_topk)
        # Adapters attach their hooks before the decode step compiles, so the graphs traced now serve every later
        # base-only step (steps with adapter rows run eagerly).
        vision_lora = None
        if config.vision_adapter and self.groups is None:
            vision_lora = vision_adapter_dir(path, self.model.has_vision)
        self.lora: LoRAManager | None = None
        if config.enable_lora or vision_lora is not None:
            self.lora = self.runner.lora = LoRAManager(self.model, detach_idle=self.runner.compiled is None)
        self.adapters = AdapterRegistry(self.lora, cfg.vocab_size, config.max_lora_rank)
        self._groups: dict[str, list[Request]] = {}
        if vision_lora is not None:
            self.load_lora_adapter(VISION_ADAPTER, str(vision_lora))
            log.info("image requests run on the vision adapter %s", vision_lora)
        for entry in config.lora_paths or []:
            name, _, lora_path = entry.partition("=")
            self.load_lora_adapter(name, lora_path)
        if self.runner.compiled is not None:
            self.runner.compiled.warm_up()
        self.draft = load_spec_draft(config, path, self.model) if config.speculative_algorithm else None
        self.hicache: HiCache | None = None
        self.cache: RadixCache | NoPrefixCache = NoPrefixCache(self.pages, self.slots)
        if config.enable_prefix_caching:
            namespace = model_fingerprint(path, config)
            if config.hicache_size > 0 or config.hicache_storage_dir:
                self.hicache = HiCache(
                    int(config.hicache_size * 1e9), config.hicache_storage_dir, config.hicache_write_policy, namespace
                )
            self.cache = RadixCache(
                self.pages,
                self.slots,
                self.runner.pool_io(),
                config.state_track_interval,
                config.max_states_per_path,
                self.hicache,
                namespace.encode(),
            )
        eos = list(cfg.eos_token_id)
        self.scheduler = Scheduler(
            self.pages,
            self.slots,
            self.cache,
            config.max_running_requests,
            config.max_num_batched_tokens,
            config.chunked_prefill_size,
            config.max_loras_per_batch if self.lora is not None else None,
        )
        self.weight_version = config.weight_version
        if self.groups is not None and self.groups.layout.dp_attn > 1:  # a scheduler and pools per attention group
            self.pages, self.slots, self.cache, self.scheduler = dp_scheduling(self, num_pages, num_slots)
        self.eos_token_ids = set(eos)
        self.sampler = Sampler(eos, seed=config.seed)
        self.spec: DFlashSpeculator | None = None
        if self.draft is not None:
            self.spec = DFlashSpeculator(
                self.draft,
                self.scheduler,
                self.sampler,
                self.runner,
                config.speculative_num_draft_tokens,
                config.speculative_draft_window_size,
                config.enable_linear_replayssm_spec,
                self.max_model_len,
            )
        # Prefill/decode disaggregation: the role's hooks in add_request, step and the output step.
        self.disagg = build_role(self) if config.disaggregation_mode != "null" else None
        self._arrivals = itertools.count()
        self._grammar: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()
        log.info(
            "capacity: %d KV tokens (%d pages of %d, %s, %d B/token), %d KDA state slots (%d for prefix-cache "
            "checkpoints), max model len %d, device %s",
            num_pages * config.page_size,
            num_pages,
            config.page_size,
            config.kv_cache_dtype,
            self.kv_bytes_per_token,
            num_slots,
            sizes.checkpoints,
            self.max_model_len,
            self.device,
        )

    @property
    def grammar(self) -> GrammarBackend:
        """The structured-output compiler, built on first use; thread-safe, so HTTP handlers compile off the engine
        thread and hand the engine compiled grammars (`SamplingParams.grammar`)."""
        with self._grammar_lock:
            if self._grammar is None:
                if self.tokenizer is None:
                    raise ValueError("response_format: this model has no tokenizer, so no grammar can be compiled")
                self._grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
            return self._grammar

    # -- requests --------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt).ids
        return list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        return_routed_experts: bool = False,
        lora_name: str | None = None,
        return_indexer_topk: bool = False,
        bootstrap: BootstrapTarget | None = None,
        images: list[ProcessedImage] | None = None,
    ) -> str:
        """Validate and queue (n sub-requests for n > 1). Nothing is allocated until the scheduler admits it.

        `return_routed_experts` / `return_indexer_topk`: the finished output carries what every token was routed to
        (needs the engine started with the matching `enable_return_*` option). `bootstrap` (disaggregated workers):
        the room pairing this request's prefill and decode halves. `images`: the prompt's preprocessed images, one
        per run of placeholder tokens (`vision.image_token_id`), in order, each run as long as the image's
        `num_tokens`."""
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        if any(not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size for t in ids):
            raise ValueError(f"prompt: token ids must be ints in [0, {self.model_config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens is longer than the context ({self.max_model_len - 1} max)")
        if self.groups is not None and self.groups.layout.dp_attn > 1:  # see DistModelRunner.execute
            if params.prompt_logprobs is not None or return_routed_experts:
                field = "prompt_logprobs" if params.prompt_logprobs is not None else "return_routed_experts"
                raise ValueError(f"{field}: not supported with attention DP (--dp-attn > 1) yet")
        for name, asked in (("routed_experts", return_routed_experts), ("indexer_topk", return_indexer_topk)):
            if asked and not getattr(self.config, f"enable_return_{name}"):
                flag = f"--enable-return-{name.replace('_', '-')}"
                raise ValueError(f"return_{name}: the server records them only when started with {flag}")
        if lora_name is None and images and VISION_ADAPTER in self.adapters.public:
            lora_name = VISION_ADAPTER  # the checkpoint's own adapter for reading images (vision_adapter.py)
        if lora_name is not None and lora_name not in self.adapters.public:
            off = "" if self.lora is not None else " (LoRA serving is off: start with --enable-lora)"
            raise ValueError(f"lora_path: adapter {lora_name!r} is not loaded{off}")
        offsets = self._image_offsets(ids, images) if images else []
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.disagg is not None:
            mode = self.config.disaggregation_mode
            if bootstrap is None:
                raise ValueError(f"bootstrap_room: required by a {mode} worker (send requests through the PD router)")
            if params.n != 1:
                raise ValueError(f"n: must be 1 on a {mode} worker (one bootstrap room per sequence)")
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        group = []
        for i in range(params.n):
            sub = params
            if params.n > 1 or max_tokens != params.max_tokens:
                seed = params.seed + i if params.seed is not None else None
                sub = SamplingParams(
                    **{
                        **vars(params),
                        "n": 1,
                        "seed": seed,
                        "max_tokens": max_tokens,
                        "min_tokens": min(params.min_tokens, max_tokens),
                    }
                )
            req = Request(request_id, ids, sub, arrival=next(self._arrivals))
            req.generator = self.sampler.make_generator(sub, self.device)
            req.matcher = new_matcher(sub.grammar) if sub.grammar is not None else None
            req.return_routed_experts, req.return_indexer_topk = return_routed_experts, return_indexer_topk
            if lora_name is not None:
                req.lora_name, req.cache_key_offset = lora_name, self.adapters.public[lora_name].cache_key_offset
            if images:
                req.images, req.image_offsets = list(images), offsets
            if self.tokenizer is not None:
                req.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, ids, sub.skip_special_tokens, sub.stop, sub.include_stop_str_in_output
                )
            group.append(req)
            if self.disagg is not None:
                req.bootstrap = bootstrap
                self.disagg.add(req)
            else:
                self.scheduler.add(req)
        self._groups[request_id] = group
        return request_id

    @property
    def supports_images(self) -> bool:
        """A vision tower is loaded and this deployment can run it (single process for now)."""
        return self.model_config.vision is not None and self.groups is None

    def _image_offsets(self, ids: list[int], images: list[ProcessedImage]) -> list[int]:
        if self.model_config.vision is None:
            raise ValueError("images: this model has no vision tower; it takes text only")
        if self.groups is not None:
            raise ValueError("images: not supported with --tp > 1 yet (the vision tower runs on one process)")
        return image_offsets(ids, images, self.model_config.vision.image_token_id)

    # -- LoRA adapters -----------------------------------------------------------------------------------
    def load_lora_adapter(
        self,
        name: str,
        path: str,
        replace: bool = False,
        version: str | None = None,
        checksum: str | None = None,
    ) -> AdapterVersion:
        """Load a PEFT adapter under `name`, or (`replace`) swap the version behind it between two steps: requests
        that started on the old version finish on it (see `AdapterRegistry`). ValueError naming what is wrong
        (missing file, shapes, rank, checksum)."""
        return self.adapters.load(name, path, self._requests_naming(name), replace, version, checksum)

    def unload_lora_adapter(self, name: str) -> None:
        """Drop an adapter no queued or running request uses (ValueError otherwise)."""
        self.adapters.unload(name, self._requests_naming(name))

    def _requests_naming(self, name: str) -> list[Request]:
        return [r for g in self._groups.values() for r in g if r.lora_name == name and not r.is_finished]

    def _collect_adapters(self) -> None:
        if self.adapters.retired:
            self.adapters.collect({r.lora_name for g in self._groups.values() for r in g if not r.is_finished})

    @property
    def lora_paths(self) -> dict[str, str]:
        """Adapter name -> the folder its current version was loaded from."""
        return {name: e.path for name, e in self.adapters.public.items()}

    @property
    def lora_names(self) -> list[str]:
        return list(self.adapters.public)

    # -- weight sync -------------------------------------------------------------------------------------
    def update_weights_from_disk(self, path: str, version: str | None = None) -> None:
        """Reload the weights in place from a checkpoint of the same architecture and flush the prefix cache.
        Call it between steps with no request started (`started_requests`): ValueError naming the problem, with
        the old weights untouched, for a checkpoint that does not match."""
        reload_weights(self, Path(path), model_fingerprint(Path(path), self.config))
        if self.runner.encoder_cache is not None:  # image features of the old tower
            self.runner.encoder_cache.clear()
        if version is not None:
            self.weight_version = version

    def retract_all(self) -> list[Request]:
        """Every started request goes back to the queue and forgets what it computed; it reruns from its prompt."""
        retracted = self.scheduler.retract_all()
        for req in retracted:
            restart(self, req)
        return retracted

    def started_requests(self) -> list[Request]:
        return [r for g in self._groups.values() for r in g if not r.is_finished and started(r)]

    def _stamp_versions(self, req: Request) -> None:
        req.weight_version = self.weight_version
        if req.lora_name is not None:
            entry = self.adapters.entries[req.lora_name]
            req.lora_version, req.lora_checksum = entry.version, entry.checksum

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its pages and state slot return to the free lists immediately."""
        hit = self.scheduler.abort(request_id)
        if self.disagg is not None:
            self.disagg.abort(request_id)
        found = self._groups.pop(request_id, None)
        self._collect_adapters()
        return bool(found or hit)

    def requests(self, request_id: str) -> list[Request]:
        """The live sub-requests of a group (empty once it finished or was aborted)."""
        return list(self._groups.get(request_id, []))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or (self.disagg is not None and self.disagg.has_work)

    # -- the loop --------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one model step; return the requests it advanced and the groups that finished during it."""
        done: list[Request] = []
        advanced: list[Request] = []
        transfers: list[TransferRecord] = []
        if self.disagg is not None:
            events = self.disagg.poll(idle=not self.scheduler.has_work)
            for req, first in events.joined:  # decode: the prompt arrived; its first token is output like any
                advanced.append(req)
                if self._append_token(req, first.token, first.logprob, first.top):
                    done.append(req)
            done += events.finished
            transfers = events.transfers
            if events.joined:  # their first token goes out now, not one decode step later (TTFT)
                advanced += [r for r in done if r not in advanced]
                finished = self._collect_finished(done)
                self._collect_adapters()
                return StepResult(advanced, finished, transfers)
        plan = self.scheduler.schedule()
        for chunk in plan.chunks:
            if chunk.request.weight_version is None:
                self._stamp_versions(chunk.request)
        done += plan.rejected
        if not plan.empty:
            if self.spec is not None:
                self.spec.propose(plan)
            logits, batch = self.runner.execute(plan)
            self._record_prompt_logprobs(plan, logits.prompt)
            if self.spec is not None:
                sampled = self.spec.commit(plan, logits.sample, batch)
            else:
                rows = [
                    SamplingRow(
                        c.request.params,
                        c.request.prompt_ids,
                        c.request.output_ids,
                        c.request.generator,
                        c.request.matcher,
                    )
                    for c in plan.chunks
                    if c.samples
                ]
                out = self.sampler.sample(logits.sample, rows)
                sampled = [[tok] for tok in zip(out.token_ids, out.logprobs, out.top_logprobs)]
            self.scheduler.advance(plan)
            stepped, finished = self._process_outputs(plan, sampled)
            advanced += stepped
            done += finished
        advanced += [r for r in done if r not in advanced]
        finished = self._collect_finished(done)
        self._collect_adapters()
        return StepResult(advanced, finished, transfers)

    def _process_outputs(
        self, plan: SchedulePlan, sampled: list[list[tuple[int, float, list | None]]]
    ) -> tuple[list[Request], list[Request]]:
        """Append each sampled token (a verify block commits several), detokenize, apply the stop rules after
        each. Returns (sampled, finished) requests.

        Sampled tokens come back in plan order of the sampling chunks, so the chunks are walked in that order.
        """
        advanced, finished = [], []
        for chunk in plan.chunks:
            if not chunk.samples:
                continue
            req = chunk.request
            advanced.append(req)
            for token, logprob, top in sampled[len(advanced) - 1]:
                if req.bootstrap is not None and self.config.disaggregation_mode == "prefill":
                    # The prefill half ends at its first token: the request keeps its pages while they move.
                    self._record_token(req, token, logprob, top)
                    self.disagg.hand_off(req, FirstToken(token, logprob, top))
                    break
                if self._append_token(req, token, logprob, top):
                    finished.append(req)
                    break
        return advanced, finished

    def _read_records(self, req: Request) -> None:
        """A finishing request's rollout records, through its page table before the pages go back to the cache
        (rows of tokens [0, num_tokens - 1): the last token never went through the model)."""
        if req.return_routed_experts or req.return_indexer_topk:
            experts, topk = self.runner.records.read(req.pages, self.config.page_size, req.num_tokens - 1)
            req.routed_experts = experts if req.return_routed_experts else None
            req.indexer_topk = topk if req.return_indexer_topk else None

    def _append_token(self, req: Request, token: int, logprob: float, top: list | None) -> bool:
        """Append one output token and apply the stop rules; True if that finished the request."""
        self._record_token(req, token, logprob, top)
        reason = stop_reason(req, token, self.eos_token_ids)
        if reason is None:
            return False
        self._read_records(req)
        self.scheduler.finish(req, reason)
        if req.detokenizer is not None and not req.detokenizer.stopped:
            req.output_text += req.detokenizer.flush()
        return True

    @staticmethod
    def _record_token(req: Request, token: int, logprob: float, top: list | None) -> None:
        req.output_ids.append(token)
        if req.params.logprobs is not None:
            req.logprobs.append(logprob)
            req.top_logprobs.append(top)

    def _record_prompt_logprobs(self, plan: SchedulePlan, prompt_logits: dict) -> None:
        for i, logits in prompt_logits.items():
            chunk = plan.chunks[i]
            req = chunk.request
            if chunk.start == 0:
                req.prompt_logprobs = [None]
            end = min(chunk.start + chunk.num_tokens + 1, len(req.prompt_ids))
            entries = prompt_logprobs(logits, req.prompt_ids[chunk.start : end], req.params.prompt_logprobs)
            req.prompt_logprobs.extend(entries[1:])

    def _collect_finished(self, done: list[Request]) -> list[RequestOutput]:
        outputs = []
        for rid in {r.request_id for r in done}:
            group = self._groups.get(rid)
            if group is None or not all(r.is_finished for r in group):
                continue
            del self._groups[rid]
            outputs.append(request_output(group))
        return outputs

    def stats(self) -> dict[str, int]:
        """Counts; pages and slots the prefix cache could evict at once are reported apart from "used"."""
        checkpoints = self.cache.device_checkpoints()
        out = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pages_used": self.pages.num_used - self.cache.evictable_pages(),
            "pages_total": self.pages.num_pages,
            "slots_used": self.slots.num_used - checkpoints,
            "computed_tokens": self.scheduler.num_computed_tokens,
        }
        if self.spec is not None:
            out.update(self.spec.stats())
        if self.disagg is not None:
            out.update(self.disagg.stats())
        if (enc := self.runner.encoder_cache) is not None:
            out |= {"vision_tower_runs": enc.tower_runs, "images_encoded": enc.images_encoded}
            out |= {"encoder_cache_hits": enc.hits, "encoder_cache_tokens": enc.tokens}
        if self.config.enable_prefix_caching:
            out.update({f"prefix_cache_{k}": v for k, v in vars(self.cache.stats).items()})
            out["prefix_cache_pages"] = self.cache.device_pages()
            out["prefix_cache_checkpoints"] = self.cache.device_checkpoints()
            if self.hicache is not None:
                out["hicache_host_bytes"] = self.hicache.host_used
                if self.hicache.disk is not None:
                    out["prefix_cache_disk_corrupt_files"] = self.hicache.disk.corrupt
                    out["hicache_disk_files_written"] = self.hicache.disk.written
                    out["prefix_cache_disk_io_errors"] = self.hicache.disk.io_errors
        return out

    def close(self) -> None:
        """Write back what only memory holds (write_back policy) so the disk tier survives a restart; let the
        disaggregation role's peers know this worker's transfers are over."""
        if self.disagg is not None:
            self.disagg.close()
        self.cache.flush()


def model_fingerprint(path: Path, config: EngineConfig) -> str:
    """What cached KV depends on: the model (config + weight files), the KV dtype and the page size."""
    h = hashlib.sha256()
    root = path if path.is_dir() else path.parent
    cfg_file = root / "config.json"
    if cfg_file.exists():
        h.update(cfg_file.read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    h.update(f"{config.dtype}:{config.page_size}".encode())
    if config.kv_cache_dtype != "auto":  # quantized pages are other bytes (auto keeps earlier fingerprints)
        h.update(config.kv_cache_dtype.encode())
    if config.enable_return_routed_experts or config.enable_return_indexer_topk:  # pages carry record rows too
        h.update(f"records:{config.enable_return_routed_experts}:{config.enable_return_indexer_topk}".encode())
    return h.hexdigest()[:24]
