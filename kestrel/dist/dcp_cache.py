"""The paged cache view of one DCP rank: it stores, and reads back, only the MLA / DSA KV of the tokens it owns.

A page of `page_size` tokens keeps `page_size / dcp` rows on each rank: global slot page·P + o (o the offset in
the page) of an owned token is local row page·(P / dcp) + local_index(o). Pages split evenly because P is a
multiple of dcp · interleave, so owner and local index of a position follow from its offset in the page, and
every rank keeps rank 0's page and slot ids. Prefill chunks read whole histories (gathered from the DCP group);
decode rows run `dcp_mla_decode` over the owned shard. KDA state is untouched (per attention-TP rank).
"""

from __future__ import annotations

import torch

from kestrel.dist import comm, dcp
from kestrel.dist.dcp_mla import DecodeShard, dcp_mla_decode, local_index
from kestrel.dist.groups import Group, ParallelLayout
from kestrel.engine.model_runner import PagedCacheView


class DCPCacheView(PagedCacheView):
    """`PagedCacheView` over this rank's token shard (same constructor, plus the DCP group and layout)."""

    def __init__(self, view: PagedCacheView, positions: torch.Tensor, page_size: int, group: Group, layout) -> None:
        self.__dict__.update(view.__dict__)
        self.group, self.interleave = group, layout.dcp_interleave
        self.candidates, self.merge = layout.dcp_candidates, layout.dcp_merge
        self.page_size = page_size
        n, inter = group.size, self.interleave
        self.local_table = self._local(self.slot_table)
        mine = (positions // inter) % n == group.rank
        self.write_rows = mine.nonzero().flatten()  # the batch's new tokens this rank stores
        self.write_slots = self._local(self.write_slots[self.write_rows])

    def _local(self, slots: torch.Tensor) -> torch.Tensor:
        """Local rows of global slots (meaningful for owned positions only)."""
        rows = self.page_size // self.group.size
        return (slots // self.page_size) * rows + local_index(slots % self.page_size, self.group.size, self.interleave)

    def store_kv(self, layer, latent, rope_key, index_key) -> None:
        rows = self.write_rows
        index_key = index_key[rows] if index_key is not None else None
        self.kv.write(layer, self.write_slots, latent[rows], rope_key[rows], index_key)

    def load_kv(self, layer, seq):
        """The whole history of a prefill sequence: every rank's owned rows, gathered and put back in order."""
        length, n = self._history_list[seq], self.group.size
        own = dcp.shard_positions(length, self.group.rank, n, self.interleave).to(self.slot_table.device)
        slots = self.local_table[seq, own]
        parts = [*self.kv.read(layer, slots), self.kv.read_index(layer, slots)]
        widths = [p.shape[-1] for p in parts if p is not None]
        packed = torch.cat([p for p in parts if p is not None], dim=-1)
        most = dcp.shard_positions(length, 0, n, self.interleave).numel()  # rank 0 holds the most
        packed = torch.cat([packed, packed.new_zeros(most - packed.shape[0], packed.shape[1])])
        got = comm.all_gather(packed[None], self.group, dim=0)  # [N, most, width]
        full = packed.new_empty(length, packed.shape[1])
        for r in range(n):
            pos = dcp.shard_positions(length, r, n, self.interleave).to(full.device)
            full[pos] = got[r, : pos.numel()]
        out = list(full.split(widths, dim=-1))
        return out[0], out[1], out[2] if len(out) > 2 else None

    def decode_shard(self, layer: int) -> DecodeShard:
        """The decode rows' owned history rows (positions of this rank's shard of the padded length)."""
        d, length = self.decode_slots.shape
        pos = dcp.shard_positions(length, self.group.rank, self.group.size, self.interleave).to(self.slot_table.device)
        slots = self.local_table[:d, pos]
        latent, rope_key = self.kv.read(layer, slots)
        return DecodeShard(self.decode_lengths(), pos, latent, rope_key, self.kv.read_index(layer, slots))

    def dcp_decode(self, attn, q_nope, q_rope, index_q, index_w) -> torch.Tensor:
        shard = self.decode_shard(attn.layer_id)
        return dcp_mla_decode(
            attn, q_nope, q_rope, index_q, index_w, shard, self.group, self.candidates, self.interleave, self.merge
        )


def dcp_view(view: PagedCacheView, positions: torch.Tensor, page_size: int, group: Group, layout: ParallelLayout):
    """This rank's DCP view of a batch's cache view (the view itself when DCP is off)."""
    if group.size == 1:
        return view
    return DCPCacheView(view, positions, page_size, group, layout)
