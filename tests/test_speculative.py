"""DFlash speculative decoding: outputs equal plain decoding, KDA rollback is exact, sampling is unbiased."""

from __future__ import annotations

import json

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.models.checkpoint import make_model
from kestrel.models.loader import load_model
from kestrel.spec.acceptance import greedy_accept, sampled_accept
from kestrel.spec.context import DraftKV, gather
from kestrel.spec.draft import DraftConfig, default_target_layers, random_draft, save_draft
from kestrel.spec.rollback import replay_bytes_per_request, snapshot_bytes_per_request
from kestrel.spec.speculator import DFlashSpeculator

NEW_TOKENS = 7
SMALL_DRAFT = dict(
    num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=32
)


@pytest.fixture(scope="module")
def targets(tiny_checkpoints, hf_kimi_linear, tmp_path_factory):
    """family -> (target folder, random-weight draft folder)."""
    root = tmp_path_factory.mktemp("spec")
    out = {}
    for family, path in (("kimi_k3", tiny_checkpoints["kimi_k3"]), ("kimi_linear", hf_kimi_linear[1])):
        model, _ = load_model(path)
        out[family] = (path, save_draft(random_draft(model, seed=1, **SMALL_DRAFT), root / family))
    return out


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 30, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]


def _greedy(n: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0, **kw)


def _spec_llm(path, draft, block: int, replay: bool = False, **kw) -> LLM:
    kw.setdefault("max_total_tokens", 2048)
    return LLM(
        str(path),
        speculative_algorithm="dflash",
        speculative_draft_model=str(draft),
        speculative_num_draft_tokens=block,
        enable_linear_replayssm_spec=replay,
        **kw,
    )


def _assert_idle(llm: LLM) -> None:
    engine = llm.engine
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0
    engine.cache.clear()
    assert engine.pages.num_used == 0 and engine.slots.num_used == 0


def _oracle(llm: LLM, reference: dict[tuple[int, ...], list[int]], vocab: int) -> None:
    """Replace the draft's proposals by the reference continuation with one wrong token at a position that varies
    with the block's start, so every acceptance length 1..B occurs (a random draft is almost always rejected)."""
    spec: DFlashSpeculator = llm.engine.spec
    propose = spec.propose

    def oracle_propose(plan):
        propose(plan)
        for c in plan.chunks:
            if not c.verify:
                continue
            req = c.request
            ref = reference[tuple(req.prompt_ids)] + [0] * 16
            at = c.start - len(req.prompt_ids) + 1
            draft = ref[at : at + c.num_tokens - 1]
            wrong = (c.start * 7 + len(req.prompt_ids)) % (c.num_tokens + 1)  # == n-1 or n: all correct
            if wrong < len(draft):
                draft[wrong] = (draft[wrong] + 1) % vocab
            c.draft = draft

    spec.propose = oracle_propose


def test_default_target_layers_spread_over_1_to_L_minus_3():
    assert default_target_layers(8, 3) == [1, 3, 5]
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert DraftConfig(hidden_size=8, vocab_size=16, num_target_layers=4).target_layer_ids == [1]


def test_greedy_accept_is_longest_matching_prefix_plus_target_token():
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert greedy_accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert greedy_accept([5, 6, 7], [4, 6, 7, 8]) == [4]


def test_draft_context_is_trimmed_to_its_written_extent_and_proposes_the_same(targets):
    """A block attends to the ring's slots up to the last written one only; the slots never written were masked out,
    so the proposals are those of the whole ring. Once the ring wraps, every slot is in use."""
    model, _ = load_model(targets["kimi_k3"][0])
    draft = random_draft(model, seed=3, **SMALL_DRAFT)
    attn = draft.layers[0].self_attn
    dk, dv, layers = attn.nope + attn.rope_dim, attn.v_dim, len(draft.layers)
    gen = torch.Generator().manual_seed(0)

    def written(kv: DraftKV, positions: list[int]) -> DraftKV:
        pos = torch.tensor(positions)
        shapes = [(len(pos), attn.n_heads, dk), (len(pos), attn.n_heads, dv)]
        kv.write(pos, [tuple(torch.randn(*shape, generator=gen) for shape in shapes) for _ in range(layers)])
        return kv

    def kv(capacity: int, positions: list[int]) -> DraftKV:
        return written(DraftKV(capacity, layers, attn.n_heads, dk, dv, torch.float32, "cpu"), positions)

    with torch.inference_mode():
        short = kv(64, [0, 1, 2, 5, 6, 7, 8, 9])  # a hole at 3-4 (a prefix-cache hit)
        ctx, mask = gather([short])
        assert short.extent == 10 and mask.shape == (1, 10) and ctx[0][0].shape[1] == 10
        assert mask[0].tolist() == [True] * 3 + [False] * 2 + [True] * 5
        last, start = torch.tensor([5]), torch.tensor([10])
        full = [(short.k[i][None], short.v[i][None]) for i in range(layers)], short.valid[None]
        torch.testing.assert_close(
            draft.block_logits(last, start, 4, ctx, mask), draft.block_logits(last, start, 4, *full)
        )
        _, mask2 = gather([short, kv(64, list(range(20)))])  # two requests: the wider extent, the other padded
        assert mask2.shape == (2, 20) and mask2[0, 10:].sum() == 0 and mask2[1].all()
        assert kv(16, list(range(20))).extent == 16  # wrapped: the whole ring


@pytest.mark.parametrize("family", ["kimi_k3", "kimi_linear"])
def test_greedy_speculative_equals_plain_for_every_block_size(family, targets):
    """Random-weight draft: for B = 2..8 and batches of 1, 8 and 32, tokens and logprobs equal plain greedy."""
    path, draft = targets[family]
    plain = LLM(str(path), max_total_tokens=2048)
    vocab = plain.engine.model_config.vocab_size
    prompts = _prompts(32, vocab, seed=3)
    want = plain.generate(prompts, _greedy(), use_tqdm=False)
    for block in range(2, 9):
        # Block 3 also runs with a 4-token draft KV window: the ring wraps, the output must not change.
        window = 4 if block == 3 else 1024
        llm = _spec_llm(path, draft, block, replay=block % 2 == 0, speculative_draft_window_size=window)
        for batch in (1, 8, 32):
            got = llm.generate(prompts[:batch], _greedy(), use_tqdm=False)
            for a, b in zip(want, got):
                assert b.outputs[0].token_ids == a.outputs[0].token_ids, (block, batch)
                assert b.outputs[0].logprobs == pytest.approx(a.outputs[0].logprobs, abs=1e-4)
        assert llm.engine.spec.num_verify_steps > 0
        _assert_idle(llm)


@pytest.mark.parametrize("replay", [False, True], ids=["snapshot", "replayssm"])
@pytest.mark.parametrize("family", ["kimi_k3", "kimi_linear"])
def test_greedy_equals_plain_when_drafts_are_often_right(family, replay, targets):
    """Oracle drafts with one planted error: every acceptance length occurs; outputs, logprobs and the freed
    pages/slots are those of plain decoding, also under preemption, chunked prefill and prefix caching."""
    path, draft = targets[family]
    plain = LLM(str(path), max_total_tokens=2048)
    vocab = plain.engine.model_config.vocab_size
    prompts = _prompts(12, vocab, seed=5)
    prompts += [prompts[0][:20] + [7, 8, 9]]  # a shared prefix: a prefix-cache hit
    n = 20
    want = plain.generate(prompts, _greedy(n), use_tqdm=False)
    reference = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, want)}
    # 192 KV tokens for 13 requests of up to 50 tokens: requests get preempted and recomputed.
    llm = _spec_llm(path, draft, 6, replay, max_total_tokens=192, page_size=4, state_track_interval=8)
    llm.engine.scheduler.chunk_cap = 8  # chunked prefill
    _oracle(llm, reference, vocab)
    got = llm.generate(prompts, _greedy(n), use_tqdm=False)
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].logprobs == pytest.approx(a.outputs[0].logprobs, abs=1e-4)
    accept = [o.outputs[0].spec_accept_length for o in got]
    assert all(a is not None for a in accept) and max(accept) > 2.5, accept
    assert set(llm.engine.spec.accept_hist) == set(range(1, 7))  # every acceptance length of block 6
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0
    _assert_idle(llm)


@pytest.mark.parametrize("replay", [False, True], ids=["snapshot", "replayssm"])
def test_kda_state_after_committing_n_tokens_equals_n_decode_steps(replay, targets):
    """For every n in 1..B: a verify block that keeps n tokens leaves the KDA slot (conv + recurrent state of
    every layer) equal to n plain decode steps, and the request's KV length is exactly n tokens longer."""
    path, draft = targets["kimi_k3"]
    block = 5
    plain = LLM(str(path), max_total_tokens=1024, enable_prefix_caching=False)
    vocab = plain.engine.model_config.vocab_size
    prompt = _prompts(1, vocab, seed=9)[0]
    ref = plain.generate([prompt], _greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    for n in range(1, block + 1):
        # Plain: prefill (samples token 1), then n decode steps.
        eng = LLM(str(path), max_total_tokens=1024, enable_prefix_caching=False).engine
        eng.add_request(prompt, _greedy(12))
        for _ in range(n + 1):
            eng.step()
        want_req = eng.scheduler.running[0]
        # Speculative: prefill, then one verify block whose drafts are right for exactly n - 1 tokens.
        spec_llm = _spec_llm(path, draft, block, replay, max_total_tokens=1024, enable_prefix_caching=False)
        spec = spec_llm.engine
        spec.add_request(prompt, _greedy(12))
        spec.step()
        drafts = ref[1:block]
        if n < block:
            drafts[n - 1] = (drafts[n - 1] + 1) % vocab
        propose = spec.spec.propose

        def forced(plan, drafts=drafts, propose=propose):
            propose(plan)
            (chunk,) = plan.chunks
            assert chunk.verify and chunk.num_tokens == block
            chunk.draft = list(drafts)

        spec.spec.propose = forced
        spec.step()
        req = spec.scheduler.running[0]
        assert req.output_ids == ref[: n + 1] == want_req.output_ids
        assert req.computed_len == want_req.computed_len == len(prompt) + n
        assert len(req.pages) == spec.pages.pages_for(req.computed_len)  # rejected positions' pages are free
        for layer in spec.model_config.kda_layers:
            for kind in ("conv", "recurrent"):
                got = getattr(spec.runner.states, kind)[layer][req.slot]
                exp = getattr(eng.runner.states, kind)[layer][want_req.slot]
                torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-4, msg=f"n={n} layer {layer} {kind}")
        assert spec.slots.num_used == 1  # snapshot slots went back


def test_rollback_memory_per_request_is_reported():
    model, cfg = load_model(make_model("kimi_k3", "tiny", "/tmp/kestrel-spec-mem", seed=0))
    snap = snapshot_bytes_per_request(cfg, 7, torch.float32)
    replay = replay_bytes_per_request(cfg, 7, torch.float32)
    c = cfg.kda_num_heads * cfg.kda_head_dim
    per_slot = len(cfg.kda_layers) * (3 * c * (cfg.kda_conv_size - 1) + cfg.kda_num_heads * cfg.kda_head_dim**2) * 4
    assert snap == 6 * per_slot
    assert replay == 7 * len(cfg.kda_layers) * (3 * c + c + cfg.kda_num_heads) * 4
    assert replay < snap


def _chi_square_p(observed: list[int], expected: list[float]) -> float:
    """p-value of Pearson's chi-square goodness of fit (df = cells - 1)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    df = sum(e > 0 for e in expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_sampled_accept_commits_tokens_distributed_as_the_target():
    """Drafts from q, accepted with min(1, p/q), residual on rejection: the first committed token follows p_0
    and, when the first draft was kept, the second follows p_1 (chi-square, fixed seeds)."""
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 6, 20000
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, dim=-1).double()
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, dim=-1).double()
    first, second = [0] * vocab, [0] * vocab
    for _ in range(trials):
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
        out = sampled_accept(drafts, p, q, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    assert _chi_square_p(first, (p[0] * trials).tolist()) > 1e-3
    kept = sum(second)
    assert kept > 2000
    assert _chi_square_p(second, (p[1] * kept).tolist()) > 1e-3


def test_sampled_speculative_preserves_the_sampling_distribution(tmp_path, monkeypatch):
    """Tiny-vocabulary target: the joint distribution of tokens 2 and 3 (both from verify blocks; 64 cells) is the
    same with and without speculation (two-sample chi-square, 3000 seeded samples each). Power: the same test
    rejects a sampler that keeps every draft (the p/q test left out)."""
    import kestrel.spec.speculator as speculator
    from kestrel.spec.acceptance import _draw

    path = make_model("kimi_linear", "tiny", tmp_path / "t", seed=4, vocab_size=8)
    model, _ = load_model(path)
    draft = save_draft(random_draft(model, seed=2, std=1.0, **SMALL_DRAFT), tmp_path / "d")
    n = 3000
    # A low temperature makes the random target's distributions peaked and unlike the draft's.
    params = [SamplingParams(temperature=0.05, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    prompt = [3, 5, 1, 7]
    kw = dict(max_total_tokens=8192, max_running_requests=128)

    def counts(llm: LLM) -> list[int]:
        cells = [0] * 64
        for o in llm.generate([prompt] * n, params, use_tqdm=False):
            t = o.outputs[0].token_ids
            cells[t[1] * 8 + t[2]] += 1
        return cells

    def p_value(a: list[int], b: list[int]) -> float:
        stat = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b) if x + y)
        df = sum(1 for x, y in zip(a, b) if x + y) - 1
        return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))

    plain = counts(LLM(str(path), **kw))
    spec_llm = _spec_llm(path, draft, 3, **kw)
    assert p_value(plain, counts(spec_llm)) > 1e-3
    assert spec_llm.engine.spec.num_committed > 1.15 * spec_llm.engine.spec.num_verify_steps  # drafts were kept

    def keep_every_draft(drafts, target_probs, draft_probs, generator=None):
        return list(drafts) + [_draw(target_probs[len(drafts)], torch.rand(1, generator=generator).item())]

    monkeypatch.setattr(speculator, "sampled_accept", keep_every_draft)
    assert p_value(plain, counts(_spec_llm(path, draft, 3, **kw))) < 1e-6


# -- the shipped draft of the embedded model ----------------------------------------------------------------


def test_shipped_draft_was_trained_on_the_shipped_target():
    """The draft records the sha256 of the target weights it was distilled from: retrain it when they change."""
    from kestrel.models.builtin import EMBEDDED_DIR
    from kestrel.models.checkpoint import text_weights_sha256
    from kestrel.spec.draft import EMBEDDED_DRAFT_DIR

    cfg = json.loads((EMBEDDED_DRAFT_DIR / "config.json").read_text())
    assert cfg["target_sha256"] == text_weights_sha256(EMBEDDED_DIR), "kestrel-mini changed: run `kestrel train dflash`"
    size = sum(f.stat().st_size for f in EMBEDDED_DRAFT_DIR.glob("*.safetensors"))
    assert 1 << 20 < size < 16 << 20


def test_trained_draft_keeps_outputs_with_stop_strings_n_and_logprobs():
    """kestrel-mini + its shipped draft: greedy chat answers (stop strings, logprobs) and seeded n=2 samples equal
    plain decoding, and the draft is accepted well beyond chance."""
    from kestrel.train.dflash import chat_prompts

    prompts = chat_prompts(30_000, 6)
    kw = dict(max_total_tokens=16384, max_model_len=2048)
    plain, spec = LLM(None, **kw), LLM(None, speculative_algorithm="dflash", speculative_num_draft_tokens=7, **kw)
    greedy = SamplingParams(temperature=0, max_tokens=48, logprobs=2, stop=["</think>", "<|tool_call_end|>"])
    for a, b in zip(plain.generate(prompts, greedy, use_tqdm=False), spec.generate(prompts, greedy, use_tqdm=False)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
        assert b.outputs[0].logprobs == pytest.approx(a.outputs[0].logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in b.outputs[0].top_logprobs] == [
            [t for t, _ in top] for top in a.outputs[0].top_logprobs
        ]
    assert spec.engine.spec.stats()["spec_accept_length"] > 2.5
    # An 8-token draft window: less context for the draft, never a different output.
    narrow = LLM(None, speculative_algorithm="dflash", speculative_draft_window_size=8, **kw)
    for a, b in zip(spec.generate(prompts, greedy, use_tqdm=False), narrow.generate(prompts, greedy, use_tqdm=False)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    sampled = SamplingParams(temperature=0.8, max_tokens=24, n=2, seed=7)
    outs = spec.generate(prompts[:2], sampled, use_tqdm=False)
    assert all(len(o.outputs) == 2 and all(c.token_ids for c in o.outputs) for o in outs)
    _assert_idle(spec)


def test_trained_draft_greedy_equals_plain_for_every_block_size():
    """kestrel-mini with its shipped draft, B = 2..8, batches of 1 and 8 chat prompts: plain greedy tokens."""
    from kestrel.train.dflash import chat_prompts

    prompts = chat_prompts(30_002, 8)
    kw = dict(max_total_tokens=16384, max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=16)
    want = [o.outputs[0].token_ids for o in LLM(None, **kw).generate(prompts, params, use_tqdm=False)]
    for block in range(2, 9):
        llm = LLM(None, speculative_algorithm="dflash", speculative_num_draft_tokens=block, **kw)
        for batch in (1, 8):
            got = llm.generate(prompts[:batch], params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in got] == want[:batch], block
        assert llm.engine.spec.stats()["spec_accept_length"] > 1.5


def test_server_reports_acceptance_in_generate_meta_info_and_metrics():
    import httpx
    from server_harness import running_server

    from kestrel.train.dflash import chat_prompts

    engine = {"speculative_algorithm": "dflash", "speculative_num_draft_tokens": 5}
    with running_server(None, engine) as (url, _):
        body = {"text": chat_prompts(30_001, 1)[0], "sampling_params": {"temperature": 0, "max_new_tokens": 32}}
        meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and 1.0 <= meta["spec_accept_length"] <= 5.0
        assert meta["completion_tokens"] <= meta["spec_verify_ct"] * 5 + 1
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "kestrel_spec_accept_length_count 1.0" in metrics


def test_compile_with_dflash_is_refused_by_name_instead_of_silently_running_eagerly():
    from kestrel.engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="compile.*speculative-algorithm"):
        EngineConfig(compile=True, speculative_algorithm="dflash")
    assert EngineConfig(compile=True).compile and EngineConfig(speculative_algorithm="dflash").speculative_algorithm


def test_a_lone_verify_block_reads_and_writes_its_states_in_place(monkeypatch):
    """Concurrency 1 (the c=1 speed target's case): every KDA layer of a verify block (and of a short prompt) reads
    and writes its states in their pool slots (no gather, no scatter), and the output still equals plain greedy
    decoding."""
    from kestrel.models.layers import kda

    calls = {"in_place": 0, "load_state": 0}
    in_place = kda.KDAAttention.segment_in_place

    def counted_in_place(self, *args):
        calls["in_place"] += 1
        return in_place(self, *args)

    kw = dict(max_total_tokens=4096, max_model_len=1024, enable_prefix_caching=False)
    prompt = "What is 12 + 7?"
    want = LLM(None, **kw).generate([prompt], _greedy(24), use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM(None, speculative_algorithm="dflash", speculative_num_draft_tokens=7, **kw)
    assert spec.engine.spec.context_pool is None  # no prefix cache, no cached tokens to give context for
    runner = spec.engine.runner
    build = runner.build

    def build_counting(inputs, decode_rows=None):
        batch, rows = build(inputs, decode_rows)
        load = batch.cache.load_state

        def counted_load(layer):
            calls["load_state"] += 1
            return load(layer)

        batch.cache.load_state = counted_load
        return batch, rows

    monkeypatch.setattr(kda.KDAAttention, "segment_in_place", counted_in_place)
    monkeypatch.setattr(runner, "build", build_counting)
    got = spec.generate([prompt], _greedy(24), use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    steps = spec.engine.spec.num_verify_steps
    kda_layers = spec.engine.model_config.kda_layers
    assert steps > 0
    # The short prompt's prefill takes the same path as the verify blocks.
    assert calls["in_place"] == (steps + 1) * len(kda_layers)
    assert calls["load_state"] == 0


def test_a_prefix_cache_hit_gives_the_draft_the_cached_tokens_context():
    """The cached prompt's draft context comes from the context pool: asked again, each request proposes exactly as
    when it computed its whole prompt (same acceptance lengths); with the pool forgotten, the cached positions are
    holes in the draft KV (and the outputs still do not change)."""
    from kestrel.train.dflash import chat_prompts

    prompts = chat_prompts(31_000, 3)
    spec = LLM(None, speculative_algorithm="dflash", max_total_tokens=16384, max_model_len=2048)
    params = _greedy(48)
    first = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(first, again):
        assert a.cached_tokens == 0 and b.cached_tokens >= 16  # whole pages of the prompt
        assert b.token_ids == a.token_ids
        assert (b.spec_verify_ct, b.spec_accept_length) == (a.spec_verify_ct, a.spec_accept_length)

    def context_after_prefill(prompt: str) -> tuple[int, torch.Tensor]:
        engine = spec.engine
        engine.add_request(engine.encode(prompt), params)
        engine.step()
        req = engine.scheduler.running[0]
        valid = req.spec.kv.valid[: len(req.prompt_ids)].clone()
        while engine.has_unfinished:
            engine.step()
        return req.cached_tokens, valid

    cached, valid = context_after_prefill(prompts[2])
    assert cached >= 64 and bool(valid.all())
    spec.engine.spec.context_pool.key.fill_(-1)  # every row forgotten
    cached, valid = context_after_prefill(prompts[2])
    assert cached >= 64 and not bool(valid[:cached].any()) and bool(valid[cached:].all())
    blind = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert [b.token_ids for b in blind] == [a.token_ids for a in first]


def test_context_pool_rows_are_used_only_for_the_token_and_position_they_were_written_for():
    from kestrel.spec.context_pool import DraftContextPool

    pool = DraftContextPool(8, 4, torch.float32, torch.device("cpu"))
    feats = torch.arange(12.0).view(3, 4)
    pool.write(torch.tensor([5, 1, 6]), torch.tensor([10, 11, 12]), torch.tensor([0, 1, 2]), feats)
    got, positions = pool.read(torch.tensor([5, 1, 6, 2]), torch.tensor([10, 99, 12, 13]), torch.tensor([0, 1, 7, 3]))
    assert positions.tolist() == [0]  # slot 1 holds another token, slot 6 another position, slot 2 nothing
    assert torch.equal(got, feats[:1])


def test_tied_candidate_draft_and_vision_adapter_were_trained_on_the_candidate():
    """kestrel/assets/kestrel-mini-tied (GRPO's base in waiting) carries its own draft and vision adapter: both must
    record its text weights, so a retrained candidate without them fails here."""
    from kestrel.engine.vision_adapter import adapter_mismatch
    from kestrel.models.builtin import EMBEDDED_DIR, TIED_DIR
    from kestrel.models.checkpoint import text_weights_sha256

    candidate = TIED_DIR
    cfg = json.loads((candidate / "dflash" / "config.json").read_text())
    assert cfg["target_sha256"] == text_weights_sha256(candidate) != text_weights_sha256(EMBEDDED_DIR)
    assert adapter_mismatch(candidate) is None
    assert json.loads((candidate / "config.json").read_text())["tie_word_embeddings"] is True
