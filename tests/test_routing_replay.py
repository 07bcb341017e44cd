"""Rollout capture (what every token was routed to, prompt rows and prefix-cache hits included) and routing replay
in the trainer: with replay the trainer's logprobs are the engine's, without it they are not."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import torch
from server_harness import running_server

from kestrel import LLM, SamplingParams
from kestrel.models.checkpoint import make_model
from kestrel.models.loader import load_model
from kestrel.train.routing_replay import Rollout, RoutingReplay, pack_rollouts, replay_of, sequence_logprobs

CAPTURE = dict(enable_return_routed_experts=True, enable_return_indexer_topk=True)
RETURN = dict(return_routed_experts=True, return_indexer_topk=True)
ENGINE = dict(dtype="float32", device="cpu", max_total_tokens=4096, page_size=4, chunked_prefill_size=16)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rollouts(llm: LLM, prompts: list[list[int]], tokens: int = 8) -> list[Rollout]:
    params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, logprobs=0, ignore_eos=True) for i in range(3)]
    outs = llm.generate(prompts, params[: len(prompts)], use_tqdm=False, **RETURN)
    return [Rollout.from_output(p, o.outputs[0]) for p, o in zip(prompts, outs)]


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return str(make_model("kimi_k3", "tiny", tmp_path_factory.mktemp("replay") / "k3", seed=0))


@pytest.fixture(scope="module")
def rollouts(k3):
    llm = LLM(k3, **ENGINE, **CAPTURE)
    return _rollouts(llm, [_tokens(40, 1), _tokens(25, 2), _tokens(33, 3)])


def _own_routing(model, rollouts):
    """The model's own decisions on the rollouts' tokens (no replay), in the records' layout."""
    batch = pack_rollouts(rollouts, model.device)
    batch.routed_experts, batch.index_topk = {}, {}
    with torch.no_grad():
        model(batch)
    moe = sorted(batch.routed_experts)
    experts = torch.stack([batch.routed_experts[layer] for layer in moe], 1).sort(-1).values
    topk = torch.stack([batch.index_topk[layer] for layer in sorted(batch.index_topk)], 1)
    recorded = torch.cat([r.routed_experts for r in rollouts]).sort(-1).values
    return experts, topk, recorded, torch.cat([r.indexer_topk for r in rollouts])


def test_rollout_records_cover_every_forwarded_token_and_match_the_trainers_routing(k3, rollouts):
    model, cfg = load_model(k3, torch.float32, torch.device("cpu"))
    moe = sum(kind == "moe" for kind in cfg.mlp_kinds)
    dsa = sum(kind == "dsa" for kind in cfg.layer_kinds)
    for r in rollouts:
        rows = len(r.prompt_ids) + len(r.output_ids) - 1
        assert r.routed_experts.shape == (rows, moe, cfg.num_experts_per_tok) and r.routed_experts.dtype == torch.int32
        assert r.indexer_topk.shape == (rows, dsa, cfg.index_topk)
        # A token at position p attends to p + 1 positions while p < top-k: exactly 0..p, then -1 padding.
        early = r.indexer_topk[: cfg.index_topk, 0]
        for p, row in enumerate(early.tolist()):
            assert row == list(range(p + 1)) + [-1] * (cfg.index_topk - p - 1)
        assert ((r.indexer_topk[cfg.index_topk :] >= 0).sum(-1) == cfg.index_topk).all()
    experts, topk, recorded_experts, recorded_topk = _own_routing(model, rollouts)
    assert torch.equal(experts, recorded_experts) and torch.equal(topk, recorded_topk)


def test_replay_gives_the_engines_logprobs_where_routing_and_selection_flip(k3, rollouts):
    model, _ = load_model(k3, torch.float32, torch.device("cpu"))
    reference = sequence_logprobs(model, rollouts, replay=False)
    unperturbed = max((t - torch.tensor(r.logprobs)).abs().max().item() for t, r in zip(reference, rollouts))
    assert unperturbed <= 1e-5
    # The built case: move what only *chooses* (router correction biases, the indexer's query projection), as a
    # bias update or an indexer step between rollout and training would. Gate weights and attention are unchanged.
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.is_moe:
                layer.mlp.gate.e_score_correction_bias.add_(torch.randn(layer.mlp.gate.n_experts, generator=gen))
            if layer.kind == "dsa":
                wq = layer.self_attn.indexer.wq_b.weight
                wq.copy_(torch.randn(wq.shape, generator=gen) * wq.std())
    experts, topk, recorded_experts, recorded_topk = _own_routing(model, rollouts)
    assert not torch.equal(experts, recorded_experts) and not torch.equal(topk, recorded_topk)

    replayed = sequence_logprobs(model, rollouts, replay=True)
    without = sequence_logprobs(model, rollouts, replay=False)
    engine = [torch.tensor(r.logprobs) for r in rollouts]
    assert max((a - b).abs().max().item() for a, b in zip(replayed, engine)) <= 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(without, engine)) > 1e-3
    # Gate weights come from the live router scores: the routers still learn under replay.
    torch.cat(replayed).sum().backward()
    for layer in model.model.layers:
        if layer.is_moe:
            assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().sum() > 0


def test_replay_hands_each_recorded_entry_out_exactly_once(k3, rollouts):
    model, cfg = load_model(k3, torch.float32, torch.device("cpu"))
    replay = replay_of(rollouts, cfg, "cpu")
    layer = next(i for i, kind in enumerate(cfg.mlp_kinds) if kind == "moe")
    replay.experts(layer)
    with pytest.raises(AssertionError, match="consumed twice"):
        replay.experts(layer)
    with pytest.raises(AssertionError, match="never consumed"):
        replay.check_consumed()
    with pytest.raises(ValueError, match="rows"):
        RoutingReplay({layer: torch.zeros(3, 2, dtype=torch.long)}, {}, rows=4)
    short = Rollout(rollouts[0].prompt_ids[:-1], rollouts[0].output_ids, rollouts[0].logprobs)
    short.routed_experts, short.indexer_topk = rollouts[0].routed_experts, rollouts[0].indexer_topk
    with pytest.raises(ValueError, match="does not fit"):
        sequence_logprobs(model, [short], replay=True)


def test_prefix_cache_hits_return_the_rows_their_tokens_got_when_first_computed(k3, tmp_path):
    """Device-tier and disk-tier hits: the cached tokens' rows come from the pool records (pages carry them down)."""
    tiers = dict(hicache_storage_dir=str(tmp_path), hicache_write_policy="write_through", state_track_interval=8)
    llm = LLM(k3, **ENGINE, **CAPTURE, **tiers)
    first = _rollouts(llm, [_tokens(40, 4)])[0]
    shared = first.prompt_ids[:32]
    model, _ = load_model(k3, torch.float32, torch.device("cpu"))
    prompt, cold = shared + _tokens(5, 5), None
    for tier in ("device", "disk"):
        if tier == "disk":
            llm.engine.cache.clear()  # the device and host tiers: only the page files remain
            records = llm.engine.runner.records
            records.experts.fill_(-7), records.index_topk.fill_(-7)  # whatever the freed pages held is gone
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=9, logprobs=0, ignore_eos=True)
        comp = llm.generate([prompt], params, use_tqdm=False, **RETURN)[0].outputs[0]
        assert comp.cached_tokens_by_tier[tier] >= 16, comp.cached_tokens_by_tier
        hit = comp.cached_tokens
        # Device: the shared prefix came from the first request. Disk: this prompt's own pages of the device run.
        source = first if tier == "device" else cold
        assert torch.equal(comp.routed_experts[:hit], source.routed_experts[:hit])
        assert torch.equal(comp.indexer_topk[:hit], source.indexer_topk[:hit])
        again = cold = Rollout.from_output(prompt, comp)
        (trainer,) = sequence_logprobs(model, [again], replay=True)
        assert (trainer - torch.tensor(again.logprobs)).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def capture_http(k3):
    engine = {**CAPTURE, "page_size": 4, "chunked_prefill_size": 16, "capture_by_default": True}
    with running_server(k3, engine) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        yield client


def test_generate_returns_base64_int32_rows_a_trainer_replays(capture_http, k3):
    model, cfg = load_model(k3, torch.float32, torch.device("cpu"))
    prompt = _tokens(30, 11)
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True},
        "return_logprob": True,
        "return_routed_experts": True,
        "return_indexer_topk": True,
    }
    out = capture_http.post("/generate", json=body).json()
    meta = out["meta_info"]
    rows, moe = len(prompt) + 5 - 1, sum(kind == "moe" for kind in cfg.mlp_kinds)
    assert len(base64.b64decode(meta["routed_experts"])) == rows * moe * cfg.num_experts_per_tok * 4
    rollout = Rollout.from_generate(out, prompt, cfg)
    assert rollout.indexer_topk.shape == (rows, 1, cfg.index_topk)
    (trainer,) = sequence_logprobs(model, [rollout], replay=True)
    assert (trainer - torch.tensor(rollout.logprobs)).abs().max() <= 1e-5

    # --capture-by-default: a body without the return_* fields (as sglang-router 0.3.2 forwards it) gets them too.
    unasked = {k: v for k, v in body.items() if k not in RETURN}
    meta_unasked = capture_http.post("/generate", json=unasked).json()["meta_info"]
    assert (meta_unasked["routed_experts"], meta_unasked["indexer_topk"]) == (
        meta["routed_experts"],
        meta["indexer_topk"],
    )

    cropped = capture_http.post("/generate", json=body | {"routed_experts_start_len": 10}).json()
    tail = Rollout.from_generate(cropped, prompt, cfg).routed_experts
    assert torch.equal(tail, rollout.routed_experts[10:])

    chunks = []
    with capture_http.stream("POST", "/generate", json=body | {"stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["meta_info"])
    assert len(chunks) > 1 and all("routed_experts" not in c for c in chunks[:-1])
    assert chunks[-1]["routed_experts"] == meta["routed_experts"] and chunks[-1]["indexer_topk"] == meta["indexer_topk"]


def test_capture_by_default_needs_a_capture_to_default_to():
    from kestrel.config import ConfigError
    from kestrel.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="capture_by_default"):
        EngineConfig(capture_by_default=True)
    assert EngineConfig(capture_by_default=True, enable_return_routed_experts=True).capture_by_default
