"""Exact KDA state rollback after a verify block: only the accepted prefix may reach the request's state slot.

Snapshot: the verify forward also saves the conv + recurrent states after each block position into n-1 borrowed
slots; commit copies the accepted one into the request's slot. Memory: (B-1) state slots per running request.

ReplaySSM: the verify forward leaves the request's slot at the committed state (its final states go to a scratch
slot) and keeps the block's KDA inputs (conv input, forget gate, β); commit replays the accepted prefix from the
committed state through the layer's own short-segment (recurrent) form. Memory: the block's inputs only.
"""

from __future__ import annotations

import torch

from kestrel.cache.state_pool import StateStorage, state_bytes_per_slot
from kestrel.config import ModelConfig
from kestrel.engine.scheduler import ScheduledChunk
from kestrel.models.decoder import CausalLM
from kestrel.models.forward_batch import ForwardBatch


def snapshot_bytes_per_request(cfg: ModelConfig, block: int, conv_dtype: torch.dtype) -> int:
    """B-1 whole state slots (conv + recurrent state of every KDA layer)."""
    return (block - 1) * state_bytes_per_slot(cfg, conv_dtype)


def replay_bytes_per_request(cfg: ModelConfig, block: int, dtype: torch.dtype) -> int:
    """B positions × every KDA layer × (conv input 3C in the model dtype + gate H·K and β H in fp32)."""
    c = cfg.kda_num_heads * cfg.kda_head_dim
    size = torch.tensor([], dtype=dtype).element_size()
    return block * len(cfg.kda_layers) * (3 * c * size + (c + cfg.kda_num_heads) * 4)


class SnapshotRollback:
    """Borrows n-1 state slots per verify block for the per-position snapshots."""

    def __init__(self, alloc_slot, free_slot) -> None:
        self.alloc_slot, self.free_slot = alloc_slot, free_slot

    def prepare(self, chunk: ScheduledChunk) -> bool:
        """Attach snapshot slots for offsets 1..n-1 (False, nothing held, when the pool has too few)."""
        slots = []
        for _ in range(chunk.num_tokens - 1):
            slot = self.alloc_slot()
            if slot is None:
                for s in slots:
                    self.free_slot(s)
                return False
            slots.append(slot)
        chunk.snapshots = [(m, slot, False) for m, slot in enumerate(slots, start=1)]
        return True

    def commit(self, states: StateStorage, items: list[tuple[int, ScheduledChunk, int]], batch: ForwardBatch) -> None:
        """items: (batch sequence, chunk, accepted tokens). The slot holds the state after the whole block."""
        for _, chunk, accepted in items:
            if accepted < chunk.num_tokens:
                states.copy(chunk.snapshots[accepted - 1][1], chunk.request.slot)
            for _, slot, _ in chunk.snapshots:
                self.free_slot(slot)
            chunk.snapshots = []


class ReplayRollback:
    """Replays the accepted prefix of each block from the committed state (ReplaySSM)."""

    def __init__(self, model: CausalLM) -> None:
        self.layers = {i: model.model.layers[i].self_attn for i in model.cfg.kda_layers}

    def prepare(self, chunk: ScheduledChunk) -> bool:
        return True

    @torch.inference_mode()
    def commit(self, states: StateStorage, items: list[tuple[int, ScheduledChunk, int]], batch: ForwardBatch) -> None:
        """One short-segment call per KDA layer over each block's accepted tokens, from the committed states
        (every block accepts at least one token: the target's own)."""
        if not items or states is None:
            return
        device = next(iter(states.conv.values())).device
        slots = torch.tensor([chunk.request.slot for _, chunk, _ in items], device=device)
        starts = [batch.seq_slice(seq).start for seq, _, _ in items]
        lens = [accepted for _, _, accepted in items]
        rows = torch.tensor([r for s, n in zip(starts, lens) for r in range(s, s + n)], device=device)
        for layer, attn in self.layers.items():
            mixed, g, beta = batch.kda_inputs[layer]
            committed = states.conv[layer].index_select(0, slots), states.recurrent[layer].index_select(0, slots)
            conv, rec = attn.replay(mixed, g, beta, rows, lens, *committed)
            states.conv[layer].index_copy_(0, slots, conv)
            states.recurrent[layer].index_copy_(0, slots, rec)
