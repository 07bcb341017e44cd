"""Pipeline parallelism (`--pp N`): the decoder's layers split into N stages, each held by its own ranks.

Each stage builds and loads only its layers' weights; the first also holds the embedding, the last the final norm
and the LM head. A step runs as micro-batches: contiguous runs of the step's token rows (a prefill chunk may be cut
into pieces, exact as chunked prefill is). Stage s receives a micro-batch's residual stream from stage s − 1 point to
point: the hidden states, or under AttnRes the partial sum and the bank of block snapshots. It runs its layers and
sends the stream on, so stage s works on micro-batch m while stage s + 1 works on m − 1. The last stage sends the
logits that rank 0 samples from. Prefill context parallelism (kestrel.dist.pcp) splits every micro-batch again,
inside a stage.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kestrel.config import ConfigError, ModelConfig
from kestrel.dist import comm, pcp
from kestrel.dist.groups import ParallelLayout
from kestrel.engine.model_runner import StepInputs, StepLogits
from kestrel.models.decoder import CausalLM, Residual
from kestrel.models.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from kestrel.dist.runner import DistModelRunner, StepMessage

ENV_PARTITION = "KESTREL_PP_LAYER_PARTITION"
PARTITION_FLAG = "--pp-partition (or KESTREL_PP_LAYER_PARTITION)"
TAG_RESIDUAL, TAG_LOGITS = 1, 2
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Running totals of this process's pipeline work: steps, micro-batches, and prefill chunks cut across micro-batches.
TOTALS: Counter[str] = Counter()


# -- the layer partition -------------------------------------------------------------------------------------
def parse_partition(text: str | None) -> tuple[int, ...] | None:
    """`a,b,...` (layers per stage) → a tuple; None or "" → None (an even split)."""
    if text is None or not text.strip():
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ConfigError(f"{PARTITION_FLAG}: layers per stage as comma-separated ints, e.g. 2,2; got {text!r}")
    return tuple(int(p) for p in parts)


def configured_partition(flag: str | None, pp: int) -> tuple[int, ...] | None:
    """The flag's partition, else (with pipeline stages) the environment's: KESTREL_PP_LAYER_PARTITION, as SGLang's
    SGLANG_PP_LAYER_PARTITION, which a one-stage engine ignores."""
    if flag:
        return parse_partition(flag)
    return parse_partition(os.environ.get(ENV_PARTITION)) if pp > 1 else None


# -- one stage's part of the model ---------------------------------------------------------------------------
@dataclass
class StageConfig(ModelConfig):
    """A pipeline stage's view of the model: the KV and state pools cover only its layers [first_layer, end_layer)."""

    first_layer: int = 0
    end_layer: int = 0

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in super().kda_layers if self.first_layer <= i < self.end_layer]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in super().attention_layers if self.first_layer <= i < self.end_layer]


def stage_config(cfg: ModelConfig, layout: ParallelLayout, stage: int) -> StageConfig:
    layers = layout.stage_layers(cfg.num_hidden_layers, stage)
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)}
    return StageConfig(**values, first_layer=layers.start, end_layer=layers.stop)


def stage_configs(cfg: ModelConfig, layout: ParallelLayout) -> list[ModelConfig]:
    """Every stage's view (the model itself without pipeline stages)."""
    return [cfg] if layout.pp == 1 else [stage_config(cfg, layout, s) for s in range(layout.pp)]


class OtherStageLayer(nn.Module):
    """Stands where a decoder layer of another pipeline stage would be (no weights here)."""


def _ends(cfg: ModelConfig, layout: ParallelLayout, stage: int) -> tuple[bool, bool]:
    """(keeps the embedding, keeps the final norm and LM head); a tied head needs the embedding's table."""
    last = stage == layout.pp - 1
    return stage == 0 or (last and cfg.tie_word_embeddings), last


def keep_stage(model: CausalLM, layout: ParallelLayout, stage: int) -> None:
    """Drop every module this stage does not run (on the meta device, before sharding: nothing is allocated)."""
    cfg = model.cfg
    layers = layout.stage_layers(cfg.num_hidden_layers, stage)
    inner = model.model
    for i in range(cfg.num_hidden_layers):
        if i not in layers:
            inner.layers[i] = OtherStageLayer()
    embed, head = _ends(cfg, layout, stage)
    if not embed:
        inner.embed_tokens = None
    if stage > 0 and cfg.vision is not None:
        model.vision_tower, model.mm_projector = None, None
    if not head:
        inner.norm, model.lm_head = None, None
        if cfg.attn_res_block_size:
            inner.output_attn_res_proj, inner.output_attn_res_norm = None, None
    model.cfg = stage_config(cfg, layout, stage)


def stage_skip(cfg: ModelConfig, layout: ParallelLayout, stage: int) -> Callable[[str], bool]:
    """Parameters (by Kestrel name) this stage does not read: other stages' layers, the ends it lacks, and the vision
    tower anywhere but the first stage (image features join the embeddings there)."""
    layers = layout.stage_layers(cfg.num_hidden_layers, stage)
    embed, head = _ends(cfg, layout, stage)

    def skip(name: str) -> bool:
        if m := _LAYER.match(name):
            return int(m.group(1)) not in layers
        if name.startswith("model.embed_tokens."):
            return not embed
        if name.startswith(("vision_tower.", "mm_projector.")):
            return stage > 0
        return not head and name.startswith(("model.norm.", "lm_head.", "model.output_attn_res_"))

    return skip


def stage_layers(model: CausalLM, layout: ParallelLayout, stage: int) -> list[nn.Module]:
    return [model.model.layers[i] for i in layout.stage_layers(model.model.cfg.num_hidden_layers, stage)]


def bank_size(cfg: ModelConfig, first_layer: int) -> int:
    """AttnRes block snapshots in the stream before layer `first_layer` (layer i pushes one when i % block == 0)."""
    block = cfg.attn_res_block_size
    return -(-first_layer // block) if block else 0


# -- micro-batches ---------------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    """Rows [lo, hi) of a step's flat tokens as inputs of their own; the first `decode_rows` sequences decode."""

    inputs: StepInputs
    lo: int
    hi: int
    decode_rows: int


def leading_decode_rows(inputs: StepInputs) -> int:
    """The step's decode rows: its leading one-token sequences (the runner's and ForwardBatch's rule)."""
    n = 0
    while n < len(inputs.extend_lens) and inputs.extend_lens[n] == 1:
        n += 1
    return n


def micro_batches(inputs: StepInputs, count: int) -> list[MicroBatch]:
    """Cut the step's token rows into `count` near-equal contiguous runs (fewer if it has fewer rows).

    A sequence cut in two becomes two chunks: the second starts where the first ends, its KV and KDA state written
    by the first on every stage before the second runs there. Snapshots go with the piece they end; sampled rows
    with the piece holding them.
    """
    total, nd = len(inputs.ids), leading_decode_rows(inputs)
    count = max(1, min(count, total))
    cuts = [total * i // count for i in range(count + 1)]
    starts = [sum(inputs.extend_lens[:i]) for i in range(len(inputs.extend_lens))]
    sampled = set(inputs.sample_rows)
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        piece, decode = StepInputs(), 0
        for i, (s, n) in enumerate(zip(starts, inputs.extend_lens)):
            a, b = max(lo, s), min(hi, s + n)
            if a >= b:
                continue
            off = a - s
            TOTALS["cut_chunks"] += b < s + n  # the rest of this chunk runs in the next micro-batch
            snaps = [(m - off, slot) for m, slot in zip(inputs.snapshots[i], inputs.snapshot_slots[i]) if off < m <= b - s]
            piece.add(
                inputs.ids[a:b],
                inputs.prefix_lens[i] + off,
                inputs.pages[i],
                inputs.state_slots[i],
                sum(r in sampled for r in range(a, b)),
                [m for m, _ in snaps],
                [slot for _, slot in snaps],
                inputs.store_slots[i],
            )
            decode += i < nd
        out.append(MicroBatch(piece, lo, hi, decode))
    return out


def needed_rows(inputs: StepInputs, prompt_chunks: list[int]) -> list[int]:
    """Flat rows whose logits the step needs, ascending: sampled rows and every row of a prompt-logprobs chunk."""
    rows = set(inputs.sample_rows)
    for i in prompt_chunks:
        start = sum(inputs.extend_lens[:i])
        rows.update(range(start, start + inputs.extend_lens[i]))
    return sorted(rows)


# -- one step over the stages ------------------------------------------------------------------------------
def build_piece(runner: DistModelRunner, piece: MicroBatch) -> ForwardBatch:
    """The micro-batch as this rank runs it: whole, or its PCP share of the prefill tokens."""
    if runner.groups.layout.pcp == 1:
        return runner.build(piece.inputs, piece.decode_rows)[0]
    share = pcp.split_step(piece.inputs, piece.decode_rows, runner.groups.layout, runner.groups.pcp.rank, runner)
    batch = runner.build(share.local, share.replicated)[0]
    batch.cache = pcp.PCPCacheView(batch.cache, share, runner.groups.pcp)
    return batch


def _final_rows(model: CausalLM, res: Residual, batch: ForwardBatch, rows: list[int]) -> torch.Tensor:
    """The final hidden states [len(rows), d] of the micro-batch's rows `rows` (gathered over the PCP group)."""
    if not isinstance(batch.cache, pcp.PCPCacheView):
        idx = torch.tensor(rows, dtype=torch.long, device=res.hidden.device)
        return model.model.finish(Residual(res.hidden[idx], [b[idx] for b in res.bank]))
    return pcp.gather_final_rows(model, res, batch.cache, rows)


@torch.inference_mode()
def run_step(runner: DistModelRunner, msg: StepMessage) -> tuple[StepLogits | None, ForwardBatch]:
    """This rank's part of one step under pipeline and/or prefill context parallelism; rank 0 gets the logits."""
    groups, model = runner.groups, runner.model
    lay, stage = groups.layout, groups.stage
    for src, dst in msg.pre_copies:
        runner.states.copy(src, dst)
    if msg.fresh_slots:
        runner.states.reset(msg.fresh_slots)
    inputs = msg.inputs
    needed = needed_rows(inputs, msg.prompt_chunks)
    first, last = stage == 0, stage == lay.pp - 1
    layers = stage_layers(model, lay, stage)
    pieces = micro_batches(inputs, lay.pp_micro_batches or lay.pp)
    TOTALS.update(steps=1, micro_batches=len(pieces))
    works, finals, batch = [], [], None
    for piece in pieces:
        batch = build_piece(runner, piece)
        if first:
            res = model.model.embed(batch)
        else:
            res = recv_residual(runner, batch, groups.pp.ranks[stage - 1], layers[0].layer_id)
        res = model.model.run_layers(res, batch, layers)
        if not last:
            works.append(send_residual(res, groups.pp.ranks[stage + 1]))
            continue
        rows = [r - piece.lo for r in needed if piece.lo <= r < piece.hi]
        finals.append(_final_rows(model, res, batch, rows))
    for src, dst in msg.post_copies:
        runner.states.copy(src, dst)
    comm.wait_all([w for w, _ in works], groups.timeout_s)
    logits = None
    if last and groups.pcp.rank == 0:  # one copy of the last stage computes the logits (vocabulary over its TP)
        logits = model.logits(torch.cat(finals))
        if lay.pp > 1 and groups.tp_rank == 0 and needed:
            comm.wait_all([comm.send(logits, 0, TAG_LOGITS)], groups.timeout_s)
    if groups.rank != 0:
        return None, batch
    if not last and needed:
        vocab = runner.model.cfg.vocab_size
        logits = comm.recv(torch.empty(len(needed), vocab), lay.world - lay.tp * lay.pcp, groups.timeout_s, TAG_LOGITS)
    elif logits is None:
        logits = torch.empty(0, runner.model.cfg.vocab_size)
    at = {r: i for i, r in enumerate(needed)}
    sample = logits[[at[r] for r in inputs.sample_rows]]
    prompt = {}
    for i in msg.prompt_chunks:
        start = sum(inputs.extend_lens[:i])
        prompt[i] = logits[[at[r] for r in range(start, start + inputs.extend_lens[i])]]
    return StepLogits(sample, prompt), batch


def send_residual(res: Residual, dst: int) -> tuple[object, torch.Tensor]:
    """Start sending the stream (hidden or partial, then the bank) to the next stage: (work, the buffer)."""
    packed = torch.stack([res.hidden, *res.bank]).contiguous()
    return comm.send(packed, dst, TAG_RESIDUAL), packed


def recv_residual(runner: DistModelRunner, batch: ForwardBatch, src: int, first_layer: int) -> Residual:
    """The stream of this micro-batch from the previous stage (its shape follows from the batch and the layer)."""
    cfg = runner.model.model.cfg
    shape = (1 + bank_size(cfg, first_layer), batch.input_ids.shape[0], cfg.hidden_size)
    got = comm.recv(torch.empty(shape, dtype=runner.model.dtype), src, runner.groups.timeout_s, TAG_RESIDUAL)
    return Residual(got[0], list(got[1:]))
