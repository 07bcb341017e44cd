"""Prefill context parallelism (`--pcp N`): each prefill's new tokens split over N copies of the model.

Every prefill sequence of a step is cut into segments: zigzag (2N equal blocks, rank r taking blocks r and 2N−1−r,
which balances causal attention) or round-robin (blocks of `--pcp-block` tokens). Segments are also cut at KDA
snapshot offsets. A PCP rank runs its segments as sequences of its own batch; decode rows run whole on every rank.
Everything per token (embedding, MLPs, MoE) is then local. Two kinds of layer need the other ranks:

- MLA / DSA: each rank all-gathers the new tokens' latents, rope keys and index keys, so its queries read every key
  they may attend to and every rank's pool holds the whole prompt (decode is replicated over the PCP ranks).
- KDA: the delta rule is affine in the state, S_out = M·S_in + H, per segment. Each rank computes its segments'
  maps (M, H) from the chunked form's per-chunk maps, and the maps are all-gathered. Every rank composes them in
  token order from the cached state: each segment's start state, the final state and the snapshot states. The
  outputs then follow from the chunk-start states. The short conv needs the kernel−1 inputs before each segment
  (the halo); they come from the other segments' last inputs, all-gathered.

The split is integers, derived identically on every rank from the broadcast step (`split_step`).
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from kestrel.dist import comm
from kestrel.dist.groups import Group, ParallelLayout
from kestrel.engine.model_runner import PagedCacheView, StepInputs
from kestrel.models.decoder import CausalLM, Residual
from kestrel.models.forward_batch import ForwardBatch
from kestrel.models.layers.kda import CHUNK_SIZE, KDAAttention
from kestrel.models.layers.kda_ops import packed_chunk_terms, packed_outputs

# Running totals of this process's PCP work: prefills split, segments, KDA layers composed across ranks, and the
# segments' state maps exchanged (how often the exchange path ran; tests read them).
TOTALS: Counter[str] = Counter()


@dataclass
class Segment:
    """Tokens [start, start + length) of prefill sequence `seq`'s new tokens, run by PCP rank `rank` as its
    `ordinal`-th segment; its end state is the state snapshot(s) `snapshots` (indices into the sequence's)."""

    seq: int
    start: int
    length: int
    rank: int
    ordinal: int = 0
    snapshots: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.length


def blocks(n: int, world: int, split: str, block: int) -> list[tuple[int, int, int]]:
    """(start, end, rank) of the non-empty blocks of n tokens: zigzag or round-robin."""
    if split == "zigzag":
        k = 2 * world
        bounds = [n * i // k for i in range(k + 1)]
        owners = [i if i < world else k - 1 - i for i in range(k)]
    else:
        bounds = [*range(0, n, block), n]
        owners = [i % world for i in range(len(bounds) - 1)]
    return [(a, b, r) for a, b, r in zip(bounds, bounds[1:], owners) if b > a]


def segments_of(seq: int, n: int, snapshots: list[int], world: int, split: str, block: int) -> list[Segment]:
    """A prefill's segments in token order: its blocks, cut at snapshot offsets, neighbours of one rank merged."""
    cuts = {m for m in snapshots if 0 < m < n}
    out: list[Segment] = []
    for a, b, rank in blocks(n, world, split, block):
        points = [a, *sorted(m for m in cuts if a < m < b), b]
        for x, y in zip(points, points[1:]):
            if out and out[-1].rank == rank and out[-1].end == x and x not in cuts:
                out[-1].length += y - x
            else:
                out.append(Segment(seq, x, y - x, rank))
    ends = {s.end: s for s in out}
    for i, m in enumerate(snapshots):
        ends[m].snapshots.append(i)
    return out


@dataclass
class PrefillShare:
    """How one step's prefill sequences split over the PCP group, and this rank's batch of it (integers)."""

    world: int
    rank: int
    local: StepInputs  # this rank's batch: the replicated sequences, then its segments in token order
    replicated: int  # its leading sequences every rank runs whole: the decode rows, or one padding row
    decode_rows: int  # the step's decode rows
    segments: list[Segment]  # every rank's, grouped by prefill sequence, in token order
    seqs: list[int]  # the prefill sequences (step order)
    seq_lens: list[int]
    state_slots: list[int]
    store_slots: list[int]
    snapshot_slots: list[list[int]]
    seq_rows: list[int]  # flat row of every step sequence's first new token
    kv_slots: list[list[int]]  # per rank: KV pool slot of each of its segment rows, in its local order
    segment_rows: dict[tuple[int, int], int]  # (rank, ordinal) → local row of the segment's first token
    _kda: dict[int, KDAPlan] = field(default_factory=dict, repr=False)

    def by_rank(self, rank: int) -> list[Segment]:
        return [s for s in self.segments if s.rank == rank]

    def locate(self, row: int) -> tuple[int | None, int]:
        """(owning rank, local row) of the step's flat row; rank None: a decode row, the same row on every rank."""
        if row < self.decode_rows:
            return None, row
        seq = bisect.bisect_right(self.seq_rows, row) - 1
        offset = row - self.seq_rows[seq]
        seg = next(s for s in self.segments if s.seq == seq and s.start <= offset < s.end)
        return seg.rank, self.segment_rows[(seg.rank, seg.ordinal)] + offset - seg.start

    def kda_plan(self, keep: int, device: torch.device) -> KDAPlan:
        if keep not in self._kda:
            self._kda[keep] = KDAPlan.build(self, keep, device)
        return self._kda[keep]


def split_step(inputs: StepInputs, decode_rows: int, layout: ParallelLayout, rank: int, runner) -> PrefillShare:
    """Split a step (or micro-batch) over the PCP group; `runner` gives the page size and the scratch page / slot."""
    world, ps = layout.pcp, runner.page_size
    seq_rows = [sum(inputs.extend_lens[:i]) for i in range(len(inputs.extend_lens))]
    seqs = list(range(decode_rows, len(inputs.extend_lens)))
    segments = [
        s
        for i in seqs
        for s in segments_of(i, inputs.extend_lens[i], inputs.snapshots[i], world, layout.pcp_split, layout.pcp_block)
    ]
    TOTALS.update(prefills=len(seqs), segments=len(segments))
    TOTALS["longest_segment"] = max([TOTALS["longest_segment"], *(s.length for s in segments)])
    kv_slots, segment_rows = [], {}
    for r in range(world):
        slots, row = [], decode_rows
        for j, s in enumerate(seg for seg in segments if seg.rank == r):
            s.ordinal, segment_rows[(r, j)] = j, row
            row += s.length
            pages, first = inputs.pages[s.seq], inputs.prefix_lens[s.seq] + s.start
            slots += [pages[p // ps] * ps + p % ps for p in range(first, first + s.length)]
        kv_slots.append(slots)
    local = StepInputs()
    for i in range(decode_rows):
        local.add(inputs.ids[i : i + 1], inputs.prefix_lens[i], inputs.pages[i], inputs.state_slots[i], 0, [], [])
    mine = [s for s in segments if s.rank == rank]
    replicated = decode_rows
    if not mine and not decode_rows:  # nothing here this step: one padding row keeps this rank in the collectives
        local.add([0], 0, [runner.scratch_page], runner.scratch_slot, 0, [], [])
        replicated = 1
    for s in mine:
        a = seq_rows[s.seq] + s.start
        local.add(
            inputs.ids[a : a + s.length],
            inputs.prefix_lens[s.seq] + s.start,
            inputs.pages[s.seq],
            inputs.state_slots[s.seq],
            0,
            [],
            [],
            inputs.store_slots[s.seq],
        )
    return PrefillShare(
        world,
        rank,
        local,
        replicated,
        decode_rows,
        segments,
        seqs,
        [inputs.extend_lens[i] for i in seqs],
        [inputs.state_slots[i] for i in seqs],
        [inputs.store_slots[i] for i in seqs],
        [inputs.snapshot_slots[i] for i in seqs],
        seq_rows,
        kv_slots,
        segment_rows,
    )


@dataclass
class KDAPlan:
    """Row indices of one step's KDA exchange (per conv width). `src` = every rank's segment tails [N·S·keep, 3C]
    (the last keep inputs of each segment, right-aligned), then each prefill's cached conv inputs [Q·keep, 3C]."""

    max_segments: int  # S: segments per rank, padded
    tail_src: torch.Tensor  # this rank's prefill rows that are tail rows ...
    tail_dst: torch.Tensor  # ... and where they go in its tails [S·keep]
    halo_rows: torch.Tensor  # [local segments · keep]: src rows of the inputs before each local segment
    final_conv_rows: torch.Tensor  # [Q · keep]: src rows of each prefill's last keep inputs
    snapshot_conv_rows: torch.Tensor  # [snapshots · keep]: the keep inputs before each snapshot offset
    snapshot_slots: torch.Tensor  # the state slots of those snapshots (composition order)
    by_seq: list[list[Segment]]

    @classmethod
    def build(cls, share: PrefillShare, keep: int, device: torch.device) -> KDAPlan:
        counts = [len(share.by_rank(r)) for r in range(share.world)]
        s_max = max(1, *counts)
        init_base = share.world * s_max * keep
        by_seq = [[s for s in share.segments if s.seq == seq] for seq in share.seqs]

        def inputs_before(q: int, offset: int) -> list[int]:
            """src rows of the keep inputs before `offset` of prefill q (its cached inputs where offset < keep)."""
            rows = []
            for p in range(offset - keep, offset):
                if p < 0:
                    rows.append(init_base + q * keep + p + keep)
                    continue
                seg = next(s for s in by_seq[q] if s.start <= p < s.end)
                rows.append((seg.rank * s_max + seg.ordinal) * keep + p - (seg.end - keep))
            return rows

        q_of = {seq: q for q, seq in enumerate(share.seqs)}
        mine = share.by_rank(share.rank)
        tail_src, tail_dst, halo, off = [], [], [], 0
        for j, s in enumerate(mine):
            for k in range(keep):
                if s.length - keep + k >= 0:
                    tail_src.append(off + s.length - keep + k)
                    tail_dst.append(j * keep + k)
            halo += inputs_before(q_of[s.seq], s.start)
            off += s.length
        final = [r for q, n in enumerate(share.seq_lens) for r in inputs_before(q, n)]
        snap_rows, snap_slots = [], []
        for q, segs in enumerate(by_seq):
            for s in segs:
                for i in s.snapshots:
                    snap_rows += inputs_before(q, s.end)
                    snap_slots.append(share.snapshot_slots[q][i])

        def t(rows: list[int]) -> torch.Tensor:
            return torch.tensor(rows, dtype=torch.long, device=device)

        return cls(s_max, t(tail_src), t(tail_dst), t(halo), t(final), t(snap_rows), t(snap_slots), by_seq)


class PCPCacheView(PagedCacheView):
    """A PCP rank's cache view: its batch's rows are the replicated sequences, then its segments. New KV of every
    rank's segments is written here too (all-gathered); KDA layers read and write whole prefills' states."""

    def __init__(self, view: PagedCacheView, share: PrefillShare, group: Group) -> None:
        self.__dict__.update(view.__dict__)
        self.share, self.group = share, group
        dev = self.slot_table.device
        nd = share.replicated
        self.replicated_slots, self.replicated_store = self.state_slots[:nd], self.store_slots[:nd]
        self.prefill_slots = torch.tensor(share.state_slots, dtype=torch.long, device=dev)
        self.prefill_store = torch.tensor(share.store_slots, dtype=torch.long, device=dev)
        counts = [len(s) for s in share.kv_slots]
        self.kv_width = max(counts)
        self.kv_slots = torch.tensor([x for s in share.kv_slots for x in s], dtype=torch.long, device=dev)
        take = [r * self.kv_width + j for r, n in enumerate(counts) for j in range(n)]
        self.kv_take = torch.tensor(take, dtype=torch.long, device=dev)

    @property
    def split(self) -> bool:
        """Any prefill this step (the same answer on every rank, so the collectives below are matched)."""
        return bool(self.share.segments)

    def store_kv(self, layer, latent, rope_key, index_key) -> None:
        if not self.split:
            return super().store_kv(layer, latent, rope_key, index_key)
        nd = self.share.replicated
        if nd:
            idx = index_key[:nd] if index_key is not None else None
            self.kv.write(layer, self.write_slots[:nd], latent[:nd], rope_key[:nd], idx)
        parts = [latent[nd:], rope_key[nd:], *([index_key[nd:]] if index_key is not None else [])]
        widths = [p.shape[-1] for p in parts]
        packed = torch.cat(parts, dim=-1)
        packed = torch.cat([packed, packed.new_zeros(self.kv_width - packed.shape[0], packed.shape[1])])
        got = comm.all_gather(packed[None], self.group, dim=0).reshape(-1, packed.shape[1])[self.kv_take]
        out = got.split(widths, dim=-1)
        self.kv.write(layer, self.kv_slots, out[0], out[1], out[2] if len(out) > 2 else None)

    def replicated_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv, rec = self.states.conv[layer], self.states.recurrent[layer]
        return conv.index_select(0, self.replicated_slots), rec.index_select(0, self.replicated_slots)

    def store_replicated(self, layer: int, conv_state: torch.Tensor, rec_state: torch.Tensor) -> None:
        self._store(layer, self.replicated_store, conv_state, rec_state)

    def prefill_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prefill's states before this step: conv [Q, 3C, keep], recurrent [Q, H, K, V]."""
        conv, rec = self.states.conv[layer], self.states.recurrent[layer]
        return conv.index_select(0, self.prefill_slots), rec.index_select(0, self.prefill_slots)

    def store_prefill(self, layer: int, conv_state: torch.Tensor, rec_state: torch.Tensor) -> None:
        self._store(layer, self.prefill_store, conv_state, rec_state)

    def store_snapshots(self, layer: int, slots: torch.Tensor, conv_state: torch.Tensor, rec: torch.Tensor) -> None:
        self._store(layer, slots, conv_state, rec)

    def _store(self, layer: int, slots: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor) -> None:
        conv, rec = self.states.conv[layer], self.states.recurrent[layer]
        conv.index_copy_(0, slots, conv_state.to(conv.dtype))
        rec.index_copy_(0, slots, rec_state.float())


class PrefillParallelKDA(nn.Module):
    """A KDA layer whose prefills are split over the PCP group (exact by composing segment state maps)."""

    def __init__(self, inner: KDAAttention, group: Group) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        view = batch.cache
        if not isinstance(view, PCPCacheView) or not view.split:
            return self.inner(x, batch)
        return kda_prefill_parallel(self.inner, x, batch, view, self.group)


def kda_prefill_parallel(
    attn: KDAAttention, x: torch.Tensor, batch: ForwardBatch, view: PCPCacheView, group: Group
) -> torch.Tensor:
    """The KDA layer over a PCP rank's batch (collective over the PCP group): decode rows as usual, segments
    through the exchanged halos and state maps. Writes every prefill's final and snapshot states."""
    share, layer = view.share, attn.layer_id
    keep, dim, heads, k_dim = attn.kernel - 1, attn.conv_dim, attn.n_heads, attn.head_dim
    mixed, g, beta, gate = attn.project(x)
    nd = share.replicated
    o = mixed.new_empty(mixed.shape[0], heads, k_dim, dtype=torch.float32)
    if nd:
        conv0, rec0 = view.replicated_states(layer)
        o[:nd], conv1, rec1 = attn.decode(mixed[:nd], g[:nd], beta[:nd], conv0, rec0)
        view.store_replicated(layer, conv1, rec1)
    plan = share.kda_plan(keep, mixed.device)
    rows = mixed[nd:]
    tails = rows.new_zeros(plan.max_segments * keep, dim)
    tails[plan.tail_dst] = rows[plan.tail_src]
    conv_init, rec_init = view.prefill_states(layer)
    src = torch.cat(
        [
            comm.all_gather(tails[None], group, dim=0).reshape(-1, dim),
            conv_init.to(rows.dtype).transpose(1, 2).reshape(-1, dim),
        ]
    )
    # This rank's segments: conv with their halos, the chunked form's per-chunk maps, and each segment's map.
    maps = torch.zeros(plan.max_segments, heads, k_dim, 2 * k_dim, dtype=torch.float32, device=x.device)
    terms = None
    if rows.shape[0]:
        packed = batch.packed_prefill(CHUNK_SIZE, keep)
        xc = rows.new_empty(packed.conv_len, dim)
        xc[packed.conv_token_rows] = rows
        xc[packed.conv_history_rows] = src[plan.halo_rows]
        q, k, v = attn.packed_qkv(xc, packed)

        def place(t: torch.Tensor) -> torch.Tensor:  # prefill rows → chunk layout, zeros in the padding
            return t.new_zeros(packed.chunk_len, *t.shape[1:]).index_copy(0, packed.chunk_rows, t)

        terms = packed_chunk_terms(*(place(t) for t in (q, k, v, g[nd:], beta[nd:])), chunk_size=CHUNK_SIZE)
        chunk_m, chunk_n = terms.M[0], terms.N[0]  # [H, Nc, K, K], [H, Nc, K, V]
        maps = maps.to(chunk_m.dtype)
        eye = torch.eye(k_dim, dtype=chunk_m.dtype, device=x.device).expand(heads, k_dim, k_dim)
        for j, (a, b) in enumerate(zip(packed.first_chunks, packed.segment_end_chunks)):
            acc = torch.cat([eye, torch.zeros_like(eye)], dim=-1)  # [M | H] of the identity map
            for n in range(a, b + 1):
                acc = chunk_m[:, n] @ acc
                acc[..., k_dim:] += chunk_n[:, n]
            maps[j] = acc
    every = comm.all_gather(maps[None], group, dim=0)  # [N, S, H, K, K + V]
    TOTALS.update(kda_layers=1, maps=len(share.segments))
    # Compose every prefill's segments in token order from its cached state.
    start_of, finals, snaps = {}, [], []
    for q, segs in enumerate(plan.by_seq):
        state = rec_init[q].to(every.dtype)
        for s in segs:
            start_of[(s.rank, s.ordinal)] = state
            m = every[s.rank, s.ordinal]
            state = m[..., :k_dim] @ state + m[..., k_dim:]
            snaps += [state] * len(s.snapshots)
        finals.append(state)
    if terms is not None:
        starts = []
        for j, (a, b) in enumerate(zip(packed.first_chunks, packed.segment_end_chunks)):
            state = start_of[(share.rank, j)]
            for n in range(a, b + 1):
                starts.append(state)
                state = chunk_m[:, n] @ state + chunk_n[:, n]
        o[nd:] = packed_outputs(terms, torch.stack(starts, dim=1))[packed.chunk_rows]
    final_conv = src[plan.final_conv_rows].view(-1, keep, dim).transpose(1, 2)
    view.store_prefill(layer, final_conv, torch.stack(finals))
    if snaps:
        snap_conv = src[plan.snapshot_conv_rows].view(-1, keep, dim).transpose(1, 2)
        view.store_snapshots(layer, plan.snapshot_slots, snap_conv, torch.stack(snaps))
    return attn._output(o, gate, x.dtype)


def wrap_kda_layers(model: CausalLM, group: Group) -> None:
    """Every KDA layer this rank holds composes its prefill segments over `group`."""
    for layer in model.model.layers:
        if isinstance(getattr(layer, "self_attn", None), KDAAttention):
            layer.self_attn = PrefillParallelKDA(layer.self_attn, group)


def gather_final_rows(model: CausalLM, res: Residual, view: PCPCacheView, rows: list[int]) -> torch.Tensor:
    """Final hidden states [len(rows), d] of the step's flat rows `rows`: each computed by the rank holding it (decode
    rows by PCP rank 0), summed over the group with zeros elsewhere (exact). A step without prefill moves nothing."""
    share = view.share
    if not view.split:  # decode rows only: every rank holds them all (the same on each rank: no exchange)
        idx = torch.tensor(rows, dtype=torch.long, device=res.hidden.device)
        return model.model.finish(Residual(res.hidden[idx], [b[idx] for b in res.bank]))
    mine, at = [], []
    for i, row in enumerate(rows):
        owner, local = share.locate(row)
        if owner == share.rank or (owner is None and share.rank == 0):
            mine.append(local)
            at.append(i)
    out = res.hidden.new_zeros(len(rows), res.hidden.shape[-1])
    if mine:
        idx = torch.tensor(mine, dtype=torch.long, device=out.device)
        out[torch.tensor(at, dtype=torch.long, device=out.device)] = model.model.finish(
            Residual(res.hidden[idx], [b[idx] for b in res.bank])
        )
    return comm.all_reduce(out, view.group)
