"""Rollout routing replay: the trainer recomputes a rollout's logprobs with the experts and DSA selections the engine
used (Miles' R3), or without them (the reference pass).

A `Rollout` is what `/generate` (or the `Engine`) returned: prompt, sampled tokens, their logprobs and, for every token
that went through the model, the experts each MoE layer routed it to and the positions each DSA layer attended to.
The trainer's forward runs over prompt + output[:-1], so forward row i has token i as input: the row those records
belong to. Under replay an MoE layer uses the recorded experts with gate weights from its live router scores (the
router still gets gradients) and a DSA layer attends to the recorded positions (its indexer still scores them, for its
own distillation loss). `RoutingReplay` hands each layer its entry once per forward and asserts that every recorded
entry was consumed exactly once.

The logprobs are the sampler's: log-softmax of the raw fp32 logits. With `model.batch_invariant` set (the trainer's
side of `--deterministic-inference`) they equal the engine's bit for bit.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch

from kestrel.config import ModelConfig
from kestrel.engine.outputs import CompletionOutput
from kestrel.models.decoder import CausalLM
from kestrel.models.forward_batch import ForwardBatch


@dataclass
class Rollout:
    """One sampled sequence and what the engine recorded for it (rows: prompt + output - 1 tokens)."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # the engine's logprob of each output token
    routed_experts: torch.Tensor | None = None  # [rows, MoE layers, top_k] int32
    indexer_topk: torch.Tensor | None = None  # [rows, DSA layers, index_topk] int32, -1 padded

    @property
    def input_ids(self) -> list[int]:
        """The tokens the engine pushed through the model (the last sampled one never was)."""
        return self.prompt_ids + self.output_ids[:-1]

    @classmethod
    def from_output(cls, prompt_ids: list[int], completion: CompletionOutput) -> Rollout:
        if completion.logprobs is None:
            raise ValueError("rollout: the request did not ask for logprobs")
        return cls(
            list(prompt_ids),
            list(completion.token_ids),
            list(completion.logprobs),
            completion.routed_experts,
            completion.indexer_topk,
        )

    @classmethod
    def from_generate(cls, result: dict, prompt_ids: list[int], cfg: ModelConfig) -> Rollout:
        """From one `/generate` result (`return_logprob`, and the capture fields it carries; start_len 0)."""
        meta = result["meta_info"]
        logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
        moe = sum(kind == "moe" for kind in cfg.mlp_kinds)
        dsa = sum(kind == "dsa" for kind in cfg.layer_kinds)
        experts = _decode(meta.get("routed_experts"), (moe, cfg.num_experts_per_tok))
        topk = _decode(meta.get("indexer_topk"), (dsa, cfg.index_topk))
        return cls(list(prompt_ids), list(result["output_ids"]), logprobs, experts, topk)


def _decode(field: str | None, row_shape: tuple[int, int]) -> torch.Tensor | None:
    if field is None:
        return None
    rows = np.frombuffer(base64.b64decode(field), dtype=np.int32)
    return torch.from_numpy(rows.copy()).view(-1, *row_shape)


class RoutingReplay:
    """A packed batch's records per layer: each MoE layer takes its experts and each DSA layer its positions once.

    Taking an entry twice raises at once; `check_consumed` (after the forward) raises if one was never taken, so a
    forward that skipped a layer's replay, or replayed the wrong rows, cannot pass silently.
    """

    def __init__(self, experts: dict[int, torch.Tensor], index_topk: dict[int, torch.Tensor], rows: int) -> None:
        for kind, table in (("routed_experts", experts), ("indexer_topk", index_topk)):
            for layer, t in table.items():
                if t.shape[0] != rows:
                    raise ValueError(f"routing replay: {kind} of layer {layer} has {t.shape[0]} rows, batch {rows}")
        self._tables = {"experts": dict(experts), "index_topk": dict(index_topk)}
        self.taken: dict[str, set[int]] = {"experts": set(), "index_topk": set()}

    def _take(self, kind: str, layer: int) -> torch.Tensor | None:
        table = self._tables[kind]
        if layer not in table:
            return None
        assert layer not in self.taken[kind], f"routing replay: layer {layer}'s {kind} consumed twice"
        self.taken[kind].add(layer)
        return table[layer]

    def experts(self, layer: int) -> torch.Tensor | None:
        return self._take("experts", layer)

    def index_topk(self, layer: int) -> torch.Tensor | None:
        return self._take("index_topk", layer)

    def check_consumed(self) -> None:
        for kind, table in self._tables.items():
            left = sorted(set(table) - self.taken[kind])
            assert not left, f"routing replay: {kind} of layers {left} recorded but never consumed"


def pack_rollouts(rollouts: list[Rollout], device: torch.device | str) -> ForwardBatch:
    """One ForwardBatch of every rollout's input tokens (whole sequences, no cache)."""
    seqs = [r.input_ids for r in rollouts]
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    positions = torch.cat([torch.arange(len(s), device=device) for s in seqs])
    return ForwardBatch(ids, positions, [len(s) for s in seqs], [0] * len(seqs))


def replay_of(rollouts: list[Rollout], cfg: ModelConfig, device: torch.device | str) -> RoutingReplay:
    """The rollouts' records, concatenated in batch order per layer (both kinds each model has must be recorded)."""
    moe = [i for i, kind in enumerate(cfg.mlp_kinds) if kind == "moe"]
    dsa = [i for i, kind in enumerate(cfg.layer_kinds) if kind == "dsa"]
    for name, layers in (("routed_experts", moe), ("indexer_topk", dsa)):
        for r in rollouts:
            table = getattr(r, name)
            if layers and table is None:
                raise ValueError(
                    f"routing replay: a rollout lacks {name} (ask /generate for return_{name}; behind "
                    "sglang-router, which drops that field, start the workers with --capture-by-default)"
                )
            if layers and table.shape[:2] != (len(r.input_ids), len(layers)):
                raise ValueError(f"routing replay: {name} {tuple(table.shape)} does not fit the rollout")

    def per_layer(name: str, layers: list[int]) -> dict[int, torch.Tensor]:
        tables = [getattr(r, name) for r in rollouts]
        return {layer: torch.cat([t[:, j] for t in tables]).to(device, torch.long) for j, layer in enumerate(layers)}

    rows = sum(len(r.input_ids) for r in rollouts)
    return RoutingReplay(per_layer("routed_experts", moe), per_layer("indexer_topk", dsa), rows)


def sequence_logprobs(
    model: CausalLM, rollouts: list[Rollout], replay: bool = True, temperatures: tuple[float, ...] = (1.0,)
) -> list[torch.Tensor]:
    """Per rollout, the trainer's logprob of each output token (under autograd if enabled): one forward over every
    rollout packed, with the recorded routing (`replay`) or the model's own (the reference pass).

    With several `temperatures`, each rollout's tensor is [len(temperatures), tokens]: log_softmax(logits / T) of
    one forward, e.g. the raw logprobs the engine reports beside the tempered policy it sampled from."""
    batch = pack_rollouts(rollouts, model.device)
    batch.replay = replay_of(rollouts, model.cfg, model.device) if replay else None
    hidden = model(batch)
    if batch.replay is not None:
        batch.replay.check_consumed()
    rows, targets, start = [], [], 0
    for r in rollouts:
        first = start + len(r.prompt_ids) - 1  # the row whose logits sampled output token 0
        rows += range(first, first + len(r.output_ids))
        targets += r.output_ids
        start += len(r.input_ids)
    logits = model.logits(hidden[torch.tensor(rows, device=model.device)])
    index = torch.tensor(targets, device=model.device)[:, None]
    lps = [torch.log_softmax(logits if t == 1.0 else logits / t, dim=-1).gather(1, index)[:, 0] for t in temperatures]
    lp = lps[0] if len(temperatures) == 1 else torch.stack(lps)
    return list(lp.split([len(r.output_ids) for r in rollouts], dim=-1))


def logprob_mismatch(rollouts: list[Rollout], trainer: list[torch.Tensor]) -> dict[str, float]:
    """Engine vs trainer on the same tokens: max / mean |Δ logprob| and the rollout→train KL estimate
    mean(engine − trainer) (k1, the quantity PPO's ratio sees)."""
    engine = torch.tensor([lp for r in rollouts for lp in r.logprobs], dtype=torch.float64)
    mine = torch.cat([t.detach().double().cpu() for t in trainer])
    diff = engine - mine
    return {"max_abs": diff.abs().max().item(), "mean_abs": diff.abs().mean().item(), "kl": diff.mean().item()}
