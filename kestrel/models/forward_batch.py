"""The one object every layer reads its batch metadata from.

A batch is a flat run of tokens from several sequences. Sequence i contributes `extend_lens[i]` new tokens,
positioned after `prefix_lens[i]` tokens whose state already lives in the cache. The first `num_decode` sequences
add exactly one token each (decode rows, rows [0, num_decode) of the flat tokens); every layer runs its batched
decode form on them and its prefill form on the sequences after them, in the same step. Layers never look up
requests: the cache view attached to the batch knows where each sequence's KV pages and state slot are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class ModelCache(Protocol):
    """What a layer may ask of the cache for the sequences of one batch (batch order, not request ids)."""

    def store_kv(
        self, layer: int, latent: torch.Tensor, rope_key: torch.Tensor, index_key: torch.Tensor | None
    ) -> None:
        """Write the new tokens' MLA latent [T, r], rope key [T, dr] and index key [T, Di] (batch order)."""

    def load_kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Full history of sequence `seq` (prefix + new tokens): latent [L, r], rope key [L, dr], index key."""

    def decode_lengths(self) -> torch.Tensor:
        """History length (prefix + the new token) of each decode row [D]."""

    def decode_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows' histories padded to [D, L_max, r] latents and [D, L_max, dr] rope keys."""

    def decode_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The latent pool [S, r], rope-key pool [S, dr] and the decode rows' slot table [D, L_max] (row i's history
        at positions < decode_lengths()[i]), for a kernel that reads the pool in place; None where the storage is
        not one plain tensor per quantity (quantized formats, the oracle path's per-sequence lists)."""

    def decode_index_keys(self, layer: int) -> torch.Tensor:
        """Decode rows' index keys padded to [D, L_max, Di] (the DSA indexer reads all of them)."""

    def decode_kv_at(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [D, k, r] and rope keys [D, k, dr] at history positions [D, k] only (sparse decode)."""

    def load_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KDA conv state [B, C, kernel-1] and recurrent state [B, H, K, V] (fp32) of every batch sequence."""

    def store_state(self, layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        """Save the states after the batch's last token of each sequence."""

    def decode_state_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The states of an all-decode batch as writable views (updated in place instead of load + store), or None."""

    def sequence_state_views(self, layer: int) -> SequenceStates | None:
        """A one-sequence batch's states as pool views (its short segment reads and writes them in place), or None."""

    def store_state_snapshots(
        self,
        layer: int,
        seqs: list[int],
        indices: list[int],
        conv_states: torch.Tensor,
        recurrent_states: torch.Tensor,
    ) -> None:
        """Save, for each i, sequence seqs[i]'s states after its `state_snapshots[seq][indices[i]]`-th new token
        (prefix cache, speculative snapshots): conv [S, C, kernel-1], recurrent [S, H, K, V], one write per pool."""


@dataclass
class SequenceStates:
    """One sequence's KDA states of one layer where they live: the layer's conv and recurrent pools, the slot its
    committed states are read from, the slot its states after its new tokens go to, and the slot of each snapshot of
    `state_snapshots` (in order). A verify block writes every state straight to its slot: no gather, stack or scatter
    copies. The views below ([1, ...] each) are built only when asked for (the compiled kernel takes the slot ids)."""

    conv_pool: torch.Tensor
    recurrent_pool: torch.Tensor
    slot: int
    store_slot: int
    snapshot_slots: list[int]

    @property
    def conv(self) -> torch.Tensor:
        return self.conv_pool.narrow(0, self.slot, 1)

    @property
    def recurrent(self) -> torch.Tensor:
        return self.recurrent_pool.narrow(0, self.slot, 1)

    @property
    def final_conv(self) -> torch.Tensor:
        return self.conv_pool.narrow(0, self.store_slot, 1)

    @property
    def final_recurrent(self) -> torch.Tensor:
        return self.recurrent_pool.narrow(0, self.store_slot, 1)

    @property
    def snapshots(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.conv_pool.narrow(0, s, 1), self.recurrent_pool.narrow(0, s, 1)) for s in self.snapshot_slots]


class Replay(Protocol):
    """Recorded routing decisions a forward must reuse (rollout routing replay, `kestrel.train.routing_replay`).

    Each layer asks once per forward; the rows are the batch's tokens in order. None: that layer decides itself.
    """

    def experts(self, layer: int) -> torch.Tensor | None:
        """Expert ids [T, top_k] an MoE layer uses instead of its router's choice (weights still from its scores)."""

    def index_topk(self, layer: int) -> torch.Tensor | None:
        """Positions [T, index_topk] (ascending, -1 padded) a DSA layer attends to instead of its indexer's top-k."""


@dataclass
class PackedPrefill:
    """Where the prefill sequences' tokens go in the two varlen layouts KDA uses, built once per batch.

    Conv layout: per sequence, its `keep` cached conv inputs then its new tokens (no padding), so one depthwise
    conv over the whole run is each sequence's own causal conv. Chunk layout: every segment (a sequence's prefill
    cut at its snapshot offsets) starts on a chunk boundary and is zero-padded to whole chunks, so the chunked
    kernel needs no padding to the longest sequence. Row tensors index the prefill tokens in batch order.
    """

    seqs: list[int]  # the prefill sequences (batch order)
    conv_len: int
    conv_token_rows: torch.Tensor  # [Tp] conv-layout row of each prefill token
    conv_out_rows: torch.Tensor  # [Tp] conv_token_rows - keep: where the conv run's output for each token is
    conv_history_rows: torch.Tensor  # [len(seqs) * keep] conv-layout rows of the cached conv inputs
    conv_state_rows: torch.Tensor  # [segments, keep] conv-layout rows whose inputs are the state after a segment
    chunk_len: int
    chunk_rows: torch.Tensor  # [Tp] chunk-layout row of each prefill token
    first_chunks: list[int]  # per sequence: its first chunk
    segment_end_chunks: list[int]  # per segment: the chunk holding its last token
    segment_seq: list[int]  # per segment: position of its sequence in `seqs`
    segment_snapshot: list[int | None]  # per segment: index into state_snapshots[seq], or None for the last one
    final_segments: torch.Tensor  # segments that end their sequence's new tokens (one per sequence, in order)
    snapshot_segments: torch.Tensor  # the other segments, whose end states are snapshots
    segment_last_token: list[int]  # per segment: offset in its sequence's new tokens of its last token
    max_segment: int
    padded_width: int  # the longest prefill sequence
    padded_rows: torch.Tensor  # [Tp] row of each prefill token in a [len(seqs), padded_width] right-padded layout
    uniform: bool  # every prefill sequence has padded_width tokens: the padded layout is the rows themselves


@dataclass
class ForwardBatch:
    """Flat tokens of several sequences plus where each one starts; see module docstring."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    extend_lens: list[int]
    prefix_lens: list[int]
    cache: ModelCache | None = None
    # Rollout routing replay: the experts and DSA selections each layer must reuse.
    replay: Replay | None = None
    # Filled by MoE layers when set to a dict: layer -> [T, top_k] expert ids actually used.
    routed_experts: dict[int, torch.Tensor] | None = None
    # Filled by DSA layers when set to a dict: layer -> [T, index_topk] positions attended (ascending, -1 padded).
    index_topk: dict[int, torch.Tensor] | None = None
    # Prefix-cache checkpoints: per sequence, sorted offsets m in [1, extend_len] after whose m-th new token the
    # KDA layers also hand their states to `cache.store_state_snapshots` (None or [] = none).
    state_snapshots: list[list[int]] | None = None
    # Speculative decoding: the decoder stores the hidden states [T, d] after these layers into `captured`
    # (the draft's context), and KDA layers store their block inputs (conv input, gate, beta) into `kda_inputs`
    # when it is a dict (ReplaySSM replays the accepted prefix from them).
    capture_layers: tuple[int, ...] = ()
    captured: dict[int, torch.Tensor] | None = None
    kda_inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # Images: the embeddings of flat rows `mm_rows` [M] are replaced by `mm_embeds` [M, d] (projected features).
    mm_rows: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None
    # At most this many leading one-token sequences are decode rows (None: all of them). A pipeline micro-batch or a
    # prefill-context rank's share of a prompt may begin with a one-token piece of a prefill, which is no decode row.
    decode_rows: int | None = None
    _starts: list[int] = field(default_factory=list, repr=False)
    _leading_single: int = field(default=0, repr=False)
    _packed: dict[tuple[int, int], PackedPrefill] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.extend_lens) != len(self.prefix_lens):
            raise ValueError("extend_lens and prefix_lens must have one entry per sequence")
        starts, total, leading = [], 0, 0
        for n in self.extend_lens:
            if n == 1 and leading == len(starts):
                leading += 1
            starts.append(total)
            total += n
        if self.decode_rows is not None:
            leading = min(leading, self.decode_rows)
        if total != self.input_ids.shape[0]:
            raise ValueError(f"extend_lens sum to {total} but input_ids has {self.input_ids.shape[0]} tokens")
        self._starts, self._leading_single = starts, leading

    @classmethod
    def single(cls, input_ids: torch.Tensor, prefix_len: int = 0, cache: ModelCache | None = None) -> ForwardBatch:
        """One sequence of new tokens after `prefix_len` cached ones."""
        n = input_ids.shape[0]
        positions = torch.arange(prefix_len, prefix_len + n, device=input_ids.device)
        return cls(input_ids=input_ids, positions=positions, extend_lens=[n], prefix_lens=[prefix_len], cache=cache)

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)

    @property
    def num_decode(self) -> int:
        """Leading one-token sequences that take the decode forms (these need a cache to read history from)."""
        return self._leading_single if self.cache is not None else 0

    @property
    def is_decode(self) -> bool:
        """Every sequence is a decode row."""
        return self.num_decode == self.num_seqs

    def prefill_bounds(self, seq: int) -> list[int]:
        """Segment boundaries of a prefill sequence's new tokens: 0, its snapshot offsets, extend_len."""
        snaps = self.state_snapshots[seq] if self.state_snapshots else []
        return [0, *snaps, self.extend_lens[seq]]

    def packed_prefill(self, chunk_size: int, keep: int) -> PackedPrefill:
        """The varlen layouts of the prefill sequences (computed once per batch and layout, shared by layers)."""
        key = (chunk_size, keep)
        if key not in self._packed:
            seqs = list(range(self.num_decode, self.num_seqs))
            conv_tok, conv_hist, conv_state, chunk_rows = [], [], [], []
            first_chunks, seg_end, seg_seq, seg_snap, seg_last = [], [], [], [], []
            width = max((self.extend_lens[seq] for seq in seqs), default=0)
            padded_rows = [i * width + t for i, seq in enumerate(seqs) for t in range(self.extend_lens[seq])]
            conv_at = chunk_at = max_segment = 0
            for i, seq in enumerate(seqs):
                n = self.extend_lens[seq]
                conv_hist.extend(range(conv_at, conv_at + keep))
                conv_tok.extend(range(conv_at + keep, conv_at + keep + n))
                first_chunks.append(chunk_at // chunk_size)
                bounds = self.prefill_bounds(seq)
                for p, (a, b) in enumerate(zip(bounds, bounds[1:])):
                    if b < a or b == 0:  # an empty segment after another one is fine: its state is that one's
                        raise ValueError(f"state_snapshots[{seq}] must be sorted offsets in [1, extend_len]")
                    chunk_rows.extend(range(chunk_at, chunk_at + b - a))
                    chunk_at += -(-(b - a) // chunk_size) * chunk_size
                    seg_end.append(chunk_at // chunk_size - 1)
                    conv_state.append(list(range(conv_at + b, conv_at + b + keep)))
                    seg_seq.append(i)
                    seg_snap.append(p if p + 2 < len(bounds) else None)
                    seg_last.append(b - 1)
                    max_segment = max(max_segment, b - a)
                conv_at += keep + n
            as_rows = lambda rows: torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)
            self._packed[key] = PackedPrefill(
                seqs=seqs,
                conv_len=conv_at,
                conv_token_rows=as_rows(conv_tok),
                conv_out_rows=as_rows([r - keep for r in conv_tok]),
                conv_history_rows=as_rows(conv_hist),
                conv_state_rows=as_rows(conv_state).view(len(conv_state), keep),
                chunk_len=chunk_at,
                chunk_rows=as_rows(chunk_rows),
                first_chunks=first_chunks,
                segment_end_chunks=seg_end,
                segment_seq=seg_seq,
                segment_snapshot=seg_snap,
                final_segments=as_rows([i for i, snap in enumerate(seg_snap) if snap is None]),
                snapshot_segments=as_rows([i for i, snap in enumerate(seg_snap) if snap is not None]),
                segment_last_token=seg_last,
                max_segment=max_segment,
                padded_width=width,
                padded_rows=as_rows(padded_rows),
                uniform=len(padded_rows) == len(seqs) * width,
            )
        return self._packed[key]

    def seq_slice(self, seq: int) -> slice:
        start = self._starts[seq]
        return slice(start, start + self.extend_lens[seq])

    def last_token_indices(self) -> torch.Tensor:
        """Row of each sequence's last new token (where next-token logits come from)."""
        idx = [s + n - 1 for s, n in zip(self._starts, self.extend_lens)]
        return torch.tensor(idx, dtype=torch.long, device=self.input_ids.device)
