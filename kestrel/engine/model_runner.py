"""Turns a `SchedulePlan` into one `ForwardBatch` over the paged caches and runs the model once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kestrel.cache.kv_pool import KVStorage, make_kv_storage
from kestrel.cache.pool_io import PoolIO
from kestrel.cache.records import RolloutRecords
from kestrel.cache.state_pool import StateStorage
from kestrel.engine.compiled_decode import CompiledDecode
from kestrel.engine.encoder_cache import EncoderCache
from kestrel.engine.scheduler import SchedulePlan
from kestrel.models.decoder import CausalLM
from kestrel.models.forward_batch import ForwardBatch, SequenceStates
from kestrel.models.layers.casts import cast, fp32
from kestrel.models.lora import LoRAManager
from kestrel.models.vision.preprocess import ProcessedImage


class PagedCacheView:
    """The `ModelCache` of one batch: token slots through one padded page table, state slots by id.

    `slot_table[i, p]` is the KV pool row of sequence i's token at position p (valid for p < history_lens[i]).
    """

    def __init__(
        self,
        kv: KVStorage,
        states: StateStorage | None,
        slot_table: torch.Tensor,
        history_lens: torch.Tensor,
        history_list: list[int],
        num_decode: int,
        write_slots: torch.Tensor,
        state_slots: torch.Tensor,
        snapshot_slots: list[list[int]] | None = None,
        store_slots: torch.Tensor | None = None,
        state_range: tuple[int, int] | None = None,
        single_slots: tuple[int, int] | None = None,
    ) -> None:
        self.kv, self.states = kv, states
        # Where each sequence's final KDA states go: its own slot, or the scratch slot for a ReplaySSM verify block
        # (its slot must keep the committed state until the accepted prefix is replayed).
        self.store_slots = state_slots if store_slots is None else store_slots
        self.slot_table, self.history_lens = slot_table, history_lens
        self.write_slots, self.state_slots, self.snapshot_slots = write_slots, state_slots, snapshot_slots
        self._history_list = history_list
        # (first slot, count) when every sequence is a decode row reading and writing consecutive state slots.
        self.state_range = state_range
        # (state slot, store slot) of a one-sequence batch.
        self.single_slots = single_slots
        # [D, L_max] for the decode rows; positions past a row's length are padding, masked by the layers.
        self.decode_slots = slot_table[:num_decode, : max(history_list[:num_decode], default=0)]

    def store_kv(self, layer, latent, rope_key, index_key) -> None:
        self.kv.write(layer, self.write_slots, latent, rope_key, index_key)

    def load_kv(self, layer, seq):
        idx = self.slot_table[seq, : self._history_list[seq]]
        return *self.kv.read(layer, idx), self.kv.read_index(layer, idx)

    def decode_lengths(self):
        return self.history_lens[: self.decode_slots.shape[0]]

    def decode_kv(self, layer):
        return self.kv.read(layer, self.decode_slots)

    def decode_pool(self, layer):
        if type(self.kv) is not KVStorage:  # quantized rows are decoded on read
            return None
        return self.kv.latent[layer], self.kv.rope_key[layer], self.decode_slots

    def decode_index_keys(self, layer):
        return self.kv.read_index(layer, self.decode_slots)

    def decode_kv_at(self, layer, positions):
        return self.kv.read(layer, self.decode_slots.gather(1, positions))

    def load_state(self, layer):
        # index_select copies whole rows; CPU advanced indexing copies element by element (1.3-4x slower here).
        slots = self.state_slots
        return self.states.conv[layer].index_select(0, slots), self.states.recurrent[layer].index_select(0, slots)

    def decode_state_views(self, layer) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The batch's KDA states as views of the pool, for an in-place decode step (no gather, no scatter: at
        batch 1 the two state copies cost ~6% of the step), or None when the slots are not one run (then
        load_state/store_state). Never under torch.compile: the slot range would be baked into the graph (checked
        first, so that the graph does not guard on whether this step's slots happened to be one run)."""
        if torch.compiler.is_compiling() or self.state_range is None or self.states is None:
            return None
        lo, n = self.state_range
        return self.states.conv[layer].narrow(0, lo, n), self.states.recurrent[layer].narrow(0, lo, n)

    def sequence_state_views(self, layer) -> SequenceStates | None:
        """Pool views of a one-sequence batch's slots (see `SequenceStates`); never under torch.compile (the slot
        ids would be baked into the graph)."""
        if torch.compiler.is_compiling() or self.single_slots is None or self.states is None:
            return None
        (slot, store), snaps = self.single_slots, self.snapshot_slots[0] if self.snapshot_slots else []
        return SequenceStates(self.states.conv[layer], self.states.recurrent[layer], slot, store, snaps)

    def store_state(self, layer, conv_state, recurrent_state) -> None:
        conv, recurrent = self.states.conv[layer], self.states.recurrent[layer]
        conv.index_copy_(0, self.store_slots, cast(conv_state, conv.dtype))
        recurrent.index_copy_(0, self.store_slots, fp32(recurrent_state))

    def store_state_snapshots(self, layer, seqs, indices, conv_states, recurrent_states) -> None:
        slots = [self.snapshot_slots[seq][index] for seq, index in zip(seqs, indices)]
        slots_t = torch.tensor(slots, dtype=torch.long, device=conv_states.device)
        self.states.conv[layer].index_copy_(0, slots_t, conv_states.to(self.states.conv[layer].dtype))
        self.states.recurrent[layer].index_copy_(0, slots_t, recurrent_states.float())


def latent_bounds(model: CausalLM) -> dict[int, float]:
    """Per MLA/DSA layer, a bound on |latent|: RMSNorm output is at most max|γ|·√r per element (NVFP4's layer scale)."""
    out = {}
    for layer in model.cfg.attention_layers:
        norm = model.model.layers[layer].self_attn.kv_a_layernorm.weight
        out[layer] = float(norm.detach().abs().max()) * norm.shape[0] ** 0.5
    return out


def chunk_tokens(prompt: list[int], output: list[int], start: int, n: int) -> list[int]:
    """Tokens [start, start + n) of prompt + output without concatenating the whole history."""
    p = len(prompt)
    if start >= p:
        return output[start - p : start - p + n]
    if start + n <= p:
        return prompt[start : start + n]
    return prompt[start:] + output[: start + n - p]


@dataclass
class StepInputs:
    """The integers of one step, gathered per sequence before they become tensors."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_of: list[int] = field(default_factory=list)  # sequence index of every token
    extend_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    history_lens: list[int] = field(default_factory=list)
    pages: list[list[int]] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)
    store_slots: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    snapshots: list[list[int]] = field(default_factory=list)
    snapshot_slots: list[list[int]] = field(default_factory=list)

    def add(
        self,
        ids: list[int],
        start: int,
        pages: list[int],
        slot: int,
        samples: int,
        snaps: list[int],
        snap_slots,
        store_slot: int | None = None,
    ) -> None:
        """`samples`: how many of the last rows are sampled (0, 1, or a whole verify block)."""
        n, seq = len(ids), len(self.extend_lens)
        self.ids += ids
        self.positions += range(start, start + n)
        self.seq_of += [seq] * n
        self.extend_lens.append(n)
        self.prefix_lens.append(start)
        self.history_lens.append(start + n)
        self.pages.append(pages)
        self.state_slots.append(slot)
        self.store_slots.append(slot if store_slot is None else store_slot)
        self.sample_rows.extend(range(len(self.ids) - samples, len(self.ids)))
        self.snapshots.append(snaps)
        self.snapshot_slots.append(snap_slots)


@dataclass
class StepLogits:
    sample: torch.Tensor  # [num sampling chunks, V] fp32, in plan order
    prompt: dict[int, torch.Tensor]  # chunk index -> [n, V] logits of every row (prompt logprobs)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_pages: int,
        page_size: int,
        num_slots: int,
        kv_dtype: torch.dtype,
        compile_max_bs: int = 0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model, self.page_size = model, page_size
        cfg, device = model.cfg, model.device
        self.device = device
        # One page and one state slot past what the allocators hand out: padding rows of a compiled decode
        # step read and write only there.
        self.scratch_page, self.scratch_slot = num_pages, num_slots
        rows = self.kv_rows_per_page(page_size)
        self.kv = make_kv_storage(cfg, num_pages + 1, rows, kv_dtype, device, kv_cache_dtype, latent_bounds(model))
        self.states = StateStorage(cfg, num_slots + 1, model.dtype, device) if cfg.kda_layers else None
        self._offsets = torch.arange(page_size, device=device)
        self.compiled = CompiledDecode(self, compile_max_bs) if compile_max_bs > 0 else None
        # Speculative decoding: target layers whose hidden states the draft reads, and whether verify blocks
        # keep their KDA inputs for a replay (ReplaySSM) instead of snapshotting states.
        self.capture_layers: tuple[int, ...] = ()
        self.replay_verify = False
        self.lora: LoRAManager | None = None  # set by the engine when it serves adapters
        self.encoder_cache: EncoderCache | None = None  # set by the engine for a model with a vision tower
        # Rollout capture: every forward writes its tokens' routed experts / DSA top-k beside their KV slots.
        self.records: RolloutRecords | None = None

    def enable_records(self, experts: bool, index_topk: bool) -> RolloutRecords:
        """Record what every computed token was routed to (before `pool_io`: the cache tiers carry the records)."""
        self.records = RolloutRecords(self.model.cfg, self.kv_slots, experts, index_topk)
        return self.records

    @property
    def kv_slots(self) -> int:
        """Token slots the page tables address (scratch page included)."""
        return (self.scratch_page + 1) * self.page_size

    def kv_rows_per_page(self, page_size: int) -> int:
        """KV pool rows per page (a decode-context-parallel rank keeps only its share of each page's tokens)."""
        return page_size

    def prepare(self, plan: SchedulePlan, pad_to: int = 0) -> tuple[ForwardBatch, torch.Tensor, list[tuple[int, int]]]:
        """One ForwardBatch for the plan, the rows whose logits are sampled, and the state-slot copies to make
        after the forward (a decode row's checkpoint is its state after the step).

        `pad_to` > len(plan.chunks) adds decode rows on the scratch page and slot (a compiled batch-size bucket).
        """
        inputs, copies = self.step_inputs(plan, pad_to)
        if self.states is not None and plan.fresh_slots:
            self.states.reset(plan.fresh_slots)
        batch, rows = self.build(inputs)
        return batch, rows, copies

    def step_inputs(self, plan: SchedulePlan, pad_to: int = 0) -> tuple[StepInputs, list[tuple[int, int]]]:
        """The plan's integers (see `prepare`) and the decode rows' state-slot copies, before any tensor exists."""
        inputs = StepInputs()
        nd = 0
        for i, c in enumerate(plan.chunks):
            req, start, n = c.request, c.start, c.num_tokens
            decode = n == 1 and nd == i  # the leading one-token chunks are the batch's decode rows
            nd += decode
            snaps = [] if decode else c.snapshots  # a decode row's snapshots become slot copies
            inputs.add(
                chunk_tokens(req.prompt_ids, req.output_ids, start, n - len(c.draft)) + c.draft,
                start,
                req.pages,
                req.slot if req.slot is not None else 0,
                c.num_sampled,
                [m for m, _, _ in snaps],
                [slot for _, slot, _ in snaps],
                self.scratch_slot if c.verify and self.replay_verify else None,
            )
        copies = [(c.request.slot, slot) for c in plan.chunks[:nd] for _, slot, _ in c.snapshots]
        for _ in range(len(plan.chunks), pad_to):
            inputs.add([0], 0, [self.scratch_page], self.scratch_slot, 0, [], [])
        return inputs, copies

    def pool_io(self) -> PoolIO:
        """The prefix cache's access to the pools (a distributed runner replays its state copies on every rank)."""
        return PoolIO(self.kv, self.states, self.page_size, self.records)

    def build(self, inputs: StepInputs, decode_rows: int | None = None) -> tuple[ForwardBatch, torch.Tensor]:
        """Lists → one metadata tensor (copied to the device once) → ForwardBatch with its paged cache view
        (`decode_rows`: see `ForwardBatch.decode_rows`)."""
        ps, hist, b = self.page_size, inputs.history_lens, len(inputs.history_lens)
        width = -(-max(hist) // ps)
        table = [self.scratch_page] * (b * width)
        for i, pages in enumerate(inputs.pages):
            used = -(-hist[i] // ps)
            table[i * width : i * width + used] = pages[:used]
        t, rows = len(inputs.ids), inputs.sample_rows
        flat = inputs.ids + inputs.positions + inputs.seq_of + table + inputs.state_slots + hist + rows
        flat += inputs.store_slots
        meta = torch.tensor(flat, dtype=torch.long).to(self.device, non_blocking=True)
        ids_t, pos_t, seq_t, table_t, slots_t, hist_t, rows_t, store_t = meta.split(
            [t, t, t, b * width, b, b, len(rows), b]
        )
        slot_table = (table_t.view(b, width, 1) * ps + self._offsets).view(b, width * ps)
        batch = ForwardBatch(ids_t, pos_t, inputs.extend_lens, inputs.prefix_lens, decode_rows=decode_rows)
        if any(inputs.snapshots):
            batch.state_snapshots = inputs.snapshots
        slots, first = inputs.state_slots, inputs.state_slots[0]
        one_run = batch._leading_single == b and slots == inputs.store_slots and slots == list(range(first, first + b))
        batch.cache = PagedCacheView(
            self.kv,
            self.states,
            slot_table,
            hist_t,
            hist,
            batch._leading_single,
            slot_table[seq_t, pos_t],
            slots_t,
            inputs.snapshot_slots,
            store_t,
            (first, b) if one_run else None,
            (first, inputs.store_slots[0]) if b == 1 else None,
        )
        return batch, rows_t

    @torch.inference_mode()
    def execute(self, plan: SchedulePlan) -> tuple[StepLogits, ForwardBatch]:
        records, capture = self.records, bool(self.capture_layers)
        images = image_pieces(plan) if self.encoder_cache is not None else []
        adapters = {c.request.lora_name for c in plan.chunks} - {None} if self.lora is not None else set()
        compiled = self.compiled is not None and records is None and not capture and not images and not adapters
        bucket = self.compiled.bucket_for(plan) if compiled else 0
        batch, rows, copies = self.prepare(plan, pad_to=bucket)
        if images:
            self.splice_images(batch, images)
        if records is not None:
            batch.routed_experts = {} if records.experts is not None else None
            batch.index_topk = {} if records.index_topk is not None else None
        if capture:
            batch.capture_layers, batch.captured = self.capture_layers, {}
            if self.replay_verify and any(c.verify for c in plan.chunks):
                batch.kda_inputs = {}
        if self.lora is not None:  # each row's adapter; the LoRA hooks group rows by adapter once per step
            slot = {name: self.lora.slot_of(name) for name in adapters}
            per_row = [slot.get(c.request.lora_name) for c in plan.chunks for _ in range(c.num_tokens)] if slot else []
            self.lora.set_rows(per_row)
        hidden = self.compiled(batch) if bucket else self.model(batch)
        for src, dst in copies:
            self.states.copy(src, dst)
        if records is not None:
            records.write(batch.cache.write_slots, batch.routed_experts, batch.index_topk)
        sample = self.model.logits(hidden[rows])
        prompt = {i: self.model.logits(hidden[batch.seq_slice(i)]) for i in prompt_logit_chunks(plan)}
        return StepLogits(sample, prompt), batch

    def splice_images(self, batch: ForwardBatch, pieces: list[ImagePiece]) -> None:
        """Point the batch's placeholder rows at their images' features (from the encoder cache)."""
        features = self.encoder_cache.features([p.image for p in pieces])
        rows = [p.row + j for p in pieces for j in range(p.count)]
        batch.mm_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        batch.mm_embeds = torch.cat([features[p.image.content_hash][p.first : p.first + p.count] for p in pieces])


@dataclass
class ImagePiece:
    """Placeholders [first, first + count) of `image` sit at flat rows [row, row + count) of the step."""

    row: int
    image: ProcessedImage
    first: int
    count: int


def image_pieces(plan: SchedulePlan) -> list[ImagePiece]:
    """The parts of image placeholder runs each chunk of the plan computes (a chunk may cut a run anywhere)."""
    pieces, base = [], 0
    for c in plan.chunks:
        req = c.request
        lo, hi = c.start, min(c.start + c.num_tokens, len(req.prompt_ids))
        for offset, image in zip(req.image_offsets, req.images):
            a, b = max(lo, offset), min(hi, offset + image.num_tokens)
            if a < b:
                pieces.append(ImagePiece(base + a - c.start, image, a - offset, b - a))
        base += c.num_tokens
    return pieces


def prompt_logit_chunks(plan: SchedulePlan) -> list[int]:
    """Chunks whose every row needs logits (prompt logprobs), in plan order."""
    return [
        i
        for i, c in enumerate(plan.chunks)
        if c.request.params.prompt_logprobs is not None and c.start < len(c.request.prompt_ids)
    ]
