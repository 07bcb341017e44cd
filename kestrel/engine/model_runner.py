"""Turns a `SchedulePlan` into one `ForwardBatch` over the paged caches and runs the model once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.cache.kv_pool import KVStorage
from kestrel.cache.state_pool import StateStorage
from kestrel.engine.scheduler import SchedulePlan
from kestrel.models.decoder import CausalLM
from kestrel.models.forward_batch import ForwardBatch


class PagedCacheView:
    """The `ModelCache` of one batch: token slots through page tables, state slots by id."""

    def __init__(
        self,
        kv: KVStorage,
        states: StateStorage | None,
        write_slots: torch.Tensor,
        history_slots: list[torch.Tensor],
        state_slots: torch.Tensor | None,
        snapshot_slots: list[list[int]] | None = None,
    ) -> None:
        self.kv, self.states = kv, states
        self.write_slots, self.history_slots, self.state_slots = write_slots, history_slots, state_slots
        self.snapshot_slots = snapshot_slots

    def store_kv(self, layer, latent, rope_key, index_key) -> None:
        self.kv.latent[layer].index_copy_(0, self.write_slots, latent.to(self.kv.latent[layer].dtype))
        self.kv.rope_key[layer].index_copy_(0, self.write_slots, rope_key.to(self.kv.rope_key[layer].dtype))
        if index_key is not None:
            self.kv.index_key[layer].index_copy_(0, self.write_slots, index_key.to(self.kv.index_key[layer].dtype))

    def load_kv(self, layer, seq):
        idx = self.history_slots[seq]
        index = self.kv.index_key[layer]
        return self.kv.latent[layer][idx], self.kv.rope_key[layer][idx], index[idx] if index is not None else None

    def load_index_key(self, layer, seq):
        return self.kv.index_key[layer][self.history_slots[seq]]

    def load_kv_at(self, layer, seq, positions):
        slots = self.history_slots[seq][positions]
        return self.kv.latent[layer][slots], self.kv.rope_key[layer][slots]

    def load_kv_padded(self, layer):
        if not hasattr(self, "_padded_slots"):
            lengths = [h.shape[0] for h in self.history_slots]
            self._lengths = torch.tensor(lengths, device=self.write_slots.device)
            self._padded_slots = torch.nn.utils.rnn.pad_sequence(self.history_slots, batch_first=True)
        idx = self._padded_slots
        index = self.kv.index_key[layer]
        return (
            self.kv.latent[layer][idx],
            self.kv.rope_key[layer][idx],
            index[idx] if index is not None else None,
            self._lengths,
        )

    def load_state(self, layer):
        return self.states.conv[layer][self.state_slots], self.states.recurrent[layer][self.state_slots]

    def store_state(self, layer, conv_state, recurrent_state) -> None:
        self.states.conv[layer].index_copy_(0, self.state_slots, conv_state.to(self.states.conv[layer].dtype))
        self.states.recurrent[layer].index_copy_(0, self.state_slots, recurrent_state.float())

    def store_state_snapshot(self, layer, seq, index, conv_state, recurrent_state) -> None:
        slot = self.snapshot_slots[seq][index]
        self.states.conv[layer][slot] = conv_state
        self.states.recurrent[layer][slot] = recurrent_state


@dataclass
class StepLogits:
    sample: torch.Tensor  # [num sampling chunks, V] fp32, in plan order
    prompt: dict[int, torch.Tensor]  # chunk index -> [n, V] logits of every row (prompt logprobs)


class ModelRunner:
    def __init__(self, model: CausalLM, num_pages: int, page_size: int, num_slots: int, kv_dtype: torch.dtype):
        self.model, self.page_size = model, page_size
        cfg, device = model.cfg, model.device
        self.device = device
        self.kv = KVStorage(cfg, num_pages, page_size, kv_dtype, device)
        self.states = StateStorage(cfg, num_slots, model.dtype, device) if cfg.kda_layers else None
        self._offsets = torch.arange(page_size, device=device)

    def _token_slots(self, pages: list[int], length: int) -> torch.Tensor:
        table = torch.tensor(pages, dtype=torch.long, device=self.device)
        return (table[:, None] * self.page_size + self._offsets[None, :]).reshape(-1)[:length]

    def prepare(self, plan: SchedulePlan) -> ForwardBatch:
        ids, positions, write, history, slots = [], [], [], [], []
        for chunk in plan.chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            ids.extend(req.all_ids[start : start + n])
            positions.extend(range(start, start + n))
            seq_slots = self._token_slots(req.pages, start + n)
            history.append(seq_slots)
            write.append(seq_slots[start:])
            slots.append(req.slot if req.slot is not None else 0)
        if self.states is not None and plan.fresh_slots:
            self.states.reset(plan.fresh_slots)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            extend_lens=[c.num_tokens for c in plan.chunks],
            prefix_lens=[c.start for c in plan.chunks],
        )
        state_slots = torch.tensor(slots, dtype=torch.long, device=self.device) if self.states is not None else None
        snapshot_slots = None
        if any(c.snapshots for c in plan.chunks):
            batch.state_snapshots = [[m for m, _, _ in c.snapshots] for c in plan.chunks]
            snapshot_slots = [[slot for _, slot, _ in c.snapshots] for c in plan.chunks]
        batch.cache = PagedCacheView(self.kv, self.states, torch.cat(write), history, state_slots, snapshot_slots)
        return batch

    @torch.inference_mode()
    def execute(self, plan: SchedulePlan, routed: bool = False) -> tuple[StepLogits, ForwardBatch]:
        batch = self.prepare(plan)
        if routed or any(c.request.routed_experts is not None for c in plan.chunks):
            batch.routed_experts = {}
        hidden = self.model(batch)
        if batch.routed_experts:
            _record_routed_experts(plan, batch)
        rows = [batch.seq_slice(i).stop - 1 for i, c in enumerate(plan.chunks) if c.samples]
        sample = self.model.logits(hidden[rows]) if rows else hidden.new_zeros(0, self.model.cfg.vocab_size).float()
        prompt = {
            i: self.model.logits(hidden[batch.seq_slice(i)])
            for i, c in enumerate(plan.chunks)
            if c.request.params.prompt_logprobs is not None and c.start < len(c.request.prompt_ids)
        }
        return StepLogits(sample, prompt), batch


def _record_routed_experts(plan: SchedulePlan, batch: ForwardBatch) -> None:
    """Append, per token sampled this step, the experts every MoE layer chose for the row that sampled it.

    That row's input is the token before the sampled one, so a request's entry k holds the routing computed
    when the token at position len(prompt) - 1 + k was the input (the convention routing replay needs).
    """
    wanted = [(i, c.request) for i, c in enumerate(plan.chunks) if c.samples and c.request.routed_experts is not None]
    if not wanted:
        return
    rows = torch.tensor([batch.seq_slice(i).stop - 1 for i, _ in wanted], device=batch.input_ids.device)
    per_layer = {layer: ids[rows].tolist() for layer, ids in sorted(batch.routed_experts.items())}
    for j, (_, req) in enumerate(wanted):
        req.routed_experts.append({layer: ids[j] for layer, ids in per_layer.items()})
