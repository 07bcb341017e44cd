"""The engine's side of a weight sync: reload the weights in place, and rerun a retracted request from its prompt.

A sync happens between two engine steps with no request started (each one finished, was aborted, or was
retracted), so every request's tokens come from one version of the weights. The reload checks the new checkpoint
against the running model from its headers first (nothing is overwritten for a mismatched one), copies every tensor
into the existing parameters (compiled graphs and CUDA graphs keep reading the same storage), then drops what the
old weights computed: the prefix cache's memory tiers, and its disk-tier namespace moves to the new checkpoint's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kestrel.engine.detokenizer import IncrementalDetokenizer
from kestrel.engine.grammar import new_matcher
from kestrel.engine.model_runner import latent_bounds
from kestrel.engine.request import Request
from kestrel.models.loader import check_checkpoint, load_weights

if TYPE_CHECKING:
    from kestrel.engine.engine import Engine

# What a retracted request keeps: who it is and what it was asked; everything else is what it computed.
_IDENTITY = frozenset({"request_id", "prompt_ids", "params", "arrival", "lora_name", "cache_key_offset"})
_IDENTITY |= {"return_routed_experts", "return_indexer_topk"}  # asked for: the rerun captures too
_IDENTITY |= {"num_computed_tokens", "num_preemptions"}  # counters of work done, kept for the statistics


def reload_weights(engine: Engine, path: Path, cache_namespace: str) -> None:
    """Check, then load the checkpoint at `path` into the engine's model in place and flush the prefix cache."""
    if engine.groups is not None:
        raise ValueError("model_path: reloading weights is not supported with more than one rank (--tp/--pcp/--pp) yet")
    if running := engine.started_requests():
        raise ValueError(f"model_path: {len(running)} request(s) started on the current weights; finish, abort or "
                         "retract them first")  # fmt: skip
    check_checkpoint(engine.model_config, path, getattr(torch, engine.config.dtype))
    load_weights(engine.model, path, progress=False)
    engine.cache.clear()  # no request holds a tree lock: every node goes
    engine.cache.set_namespace(cache_namespace)
    engine.runner.kv.set_latent_amax(latent_bounds(engine.model))  # NVFP4's per-layer scale follows the norms


def restart(engine: Engine, req: Request) -> None:
    """Forget everything `req` computed (outputs, logprobs, captures, sampling and draft state, versions): it
    reruns from its prompt. Lists are emptied and other fields reset to their defaults, so a record added to
    `Request` later is forgotten too; what the request was asked for is rebuilt as `add_request` built it."""
    for f in dataclasses.fields(req):
        if f.name in _IDENTITY:
            continue
        value = getattr(req, f.name)
        if isinstance(value, list):
            value.clear()
        elif f.default is not dataclasses.MISSING:
            setattr(req, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(req, f.name, f.default_factory())
    params = req.params
    req.generator = engine.sampler.make_generator(params, engine.device)
    req.matcher = new_matcher(params.grammar) if params.grammar is not None else None
    if engine.tokenizer is not None:
        req.detokenizer = IncrementalDetokenizer(
            engine.tokenizer, req.prompt_ids, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
        )
    current = engine.adapters.current(req.lora_name) if req.lora_name is not None else None
    if current is not None:  # on a retired adapter version: the rerun takes the current one (if still loaded)
        req.lora_name, req.cache_key_offset = current.name, current.cache_key_offset
