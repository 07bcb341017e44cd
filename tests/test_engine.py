"""Engine paths (batched, chunked, preempted, staggered) equal the single-request reference path."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.models.simple_cache import greedy_generate

FAMILIES = ["kimi_linear", "deepseek_v32", "kimi_k3"]
NEW_TOKENS = 6


def _prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]


def _reference(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS):
    out = []
    for p in prompts:
        tokens, logits = greedy_generate(llm.engine.model, p, n)
        lp = torch.log_softmax(logits, dim=-1)
        out.append((tokens, [float(lp[i, t]) for i, t in enumerate(tokens)]))
    return out


def _greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)


def _assert_matches_reference(llm: LLM, prompts, outputs, n: int = NEW_TOKENS) -> None:
    for (ref_tokens, ref_lp), out in zip(_reference(llm, prompts, n), outputs):
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens
        assert comp.logprobs == pytest.approx(ref_lp, abs=1e-4)
        assert comp.finish_reason == "length"


def _assert_all_freed(llm: LLM) -> None:
    """Idle: everything allocated belongs to the prefix cache, and clearing the cache frees every id."""
    engine = llm.engine
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0 and stats["running"] == stats["waiting"] == 0
    engine.cache.check_counters()
    engine.cache.clear()
    engine.cache.check_counters()
    assert engine.pages.num_used == 0 and engine.slots.num_used == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_one_request_matches_reference(family, tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints[family]), max_total_tokens=1024)
    prompts = _prompts(1, 259, seed=1, lo=40, hi=41)
    _assert_matches_reference(llm, prompts, llm.generate(prompts, _greedy(), use_tqdm=False))
    _assert_all_freed(llm)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [7, 64, -1])
def test_sixteen_requests_batched_and_chunked_match_reference(family, chunk, tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints[family]), max_total_tokens=4096, chunked_prefill_size=chunk, page_size=8)
    prompts = _prompts(16, 259, seed=2)
    _assert_matches_reference(llm, prompts, llm.generate(prompts, _greedy(), use_tqdm=False))
    _assert_all_freed(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_arriving_while_others_decode_run_mixed_steps(family, tiny_checkpoints):
    """Prompts join while others decode: those steps run decode rows and prefill chunks in one forward."""
    llm = LLM(str(tiny_checkpoints[family]), max_total_tokens=4096, chunked_prefill_size=16)
    prompts = _prompts(6, 259, seed=3)
    engine = llm.engine
    steps = _spy_batches(engine)
    ids, results = [], {}
    for i, p in enumerate(prompts):
        ids.append(engine.add_request(p, _greedy(8)))
        for _ in range(2 + i):
            for out in engine.step().finished:
                results[out.request_id] = out
    while engine.has_unfinished:
        for out in engine.step().finished:
            results[out.request_id] = out
    _assert_matches_reference(llm, prompts, [results[i] for i in ids], 8)
    _assert_all_freed(llm)
    mixed = [(nd, n) for nd, n in steps if 0 < nd < n]
    assert len(mixed) >= 5, steps  # every arrival after the first joins decoding requests


def test_requests_admitted_together_decode_their_states_in_place(tiny_checkpoints):
    """Request slots come from the low end, checkpoints from the high end: requests admitted together hold one run of
    slots, so their decode steps update the KDA states in the pool (no gather and scatter), matching the reference."""
    llm = LLM(str(tiny_checkpoints["kimi_linear"]), max_total_tokens=4096, page_size=8)
    llm.generate(_prompts(2, 259, seed=5), _greedy(3), use_tqdm=False)  # their slots come back, and checkpoints stay
    engine, runs = llm.engine, []
    execute = engine.runner.execute

    def spy(plan, *args, **kwargs):
        logits, batch = execute(plan, *args, **kwargs)
        if batch.num_decode == batch.num_seqs > 1:
            runs.append(batch.cache.state_range)
        return logits, batch

    engine.runner.execute = spy
    prompts = _prompts(8, 259, seed=6)
    _assert_matches_reference(llm, prompts, llm.generate(prompts, _greedy(), use_tqdm=False))
    assert len(runs) >= NEW_TOKENS - 1 and all(r is not None and r[1] == 8 for r in runs), runs
    _assert_all_freed(llm)


def _spy_batches(engine) -> list[tuple[int, int]]:
    """Record (decode rows, sequences) of every batch the runner executes."""
    seen, execute = [], engine.runner.execute

    def spy(plan, *args, **kwargs):
        logits, batch = execute(plan, *args, **kwargs)
        seen.append((batch.num_decode, batch.num_seqs))
        return logits, batch

    engine.runner.execute = spy
    return seen


@pytest.mark.slow
def test_compiled_decode_matches_eager_reference_in_every_bucket(tiny_checkpoints):
    """--compile: pure decode steps of 1, 2 and 3 (padded to 4) rows run the compiled graph; same tokens."""
    from torch._dynamo.utils import counters

    llm = LLM(str(tiny_checkpoints["kimi_k3"]), max_total_tokens=4096, page_size=8, compile=True, compile_max_bs=4)
    compiled = llm.engine.runner.compiled
    assert compiled.buckets == [1, 2, 4]
    graphs_at_start_up = counters["stats"]["unique_graphs"]
    ran, call = [], compiled.__class__.__call__
    compiled.__class__.__call__ = lambda self, batch: (ran.append(batch.num_seqs), call(self, batch))[1]
    try:
        prompts = _prompts(3, 259, seed=8, lo=20, hi=90)  # DSA histories past top-k (16): the gathered form
        params = [_greedy(n) for n in (4, 9, 14)]  # decode batches shrink 3 -> 2 -> 1 as requests finish
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        compiled.__class__.__call__ = call
    assert set(ran) == {1, 2, 4}  # the 3-row steps padded to the 4 bucket
    # Histories crossed page boundaries (page size 8) without a graph compiled mid-serving.
    assert counters["stats"]["unique_graphs"] == graphs_at_start_up
    for prompt, out, n in zip(prompts, outputs, (4, 9, 14)):
        _assert_matches_reference(llm, [prompt], [out], n)
    _assert_all_freed(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_pool_preempts_and_still_matches(family, tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints[family]), max_total_tokens=96, page_size=4, chunked_prefill_size=8)
    prompts = _prompts(6, 259, seed=4, lo=20, hi=40)
    outputs = llm.generate(prompts, _greedy(10), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_matches_reference(llm, prompts, outputs, 10)
    _assert_all_freed(llm)


def test_request_that_can_never_fit_finishes_with_error(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["kimi_linear"]), max_total_tokens=32, page_size=4)
    ok, too_big = _prompts(1, 259, lo=10, hi=11)[0], _prompts(1, 259, lo=50, hi=51)[0]
    outs = llm.generate([ok, too_big], _greedy(4), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "abort" and "KV cache" in outs[1].outputs[0].error
    _assert_all_freed(llm)


def test_abort_frees_pages_and_slot_at_once(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["kimi_k3"]), max_total_tokens=1024)
    engine = llm.engine
    rid = engine.add_request(_prompts(1, 259, lo=30, hi=31)[0], _greedy(50))
    engine.step()
    assert engine.stats()["pages_used"] > 0 and engine.stats()["slots_used"] == 1
    assert engine.abort(rid)
    _assert_all_freed(llm)
    assert not engine.has_unfinished


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens")],
)
def test_bad_sampling_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context_is_rejected_and_nothing_allocated(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["kimi_linear"]), max_total_tokens=1024, max_model_len=64)
    with pytest.raises(ValueError, match="longer than the context"):
        llm.generate([[5] * 64], _greedy(), use_tqdm=False)
    _assert_all_freed(llm)


def test_seeded_request_same_alone_and_in_batch(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["kimi_k3"]), max_total_tokens=4096)
    prompts = _prompts(8, 259, seed=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = [seeded] + [SamplingParams(temperature=0.8, max_tokens=5 + i, ignore_eos=True) for i in range(7)]
    batched = llm.generate(prompts, mixed, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched


def test_n_samples_and_text_output(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["kimi_linear"]), max_total_tokens=2048)
    out = llm.generate(
        "Hello", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 5 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    _assert_all_freed(llm)


def _rows_by_query(recorded) -> dict[tuple[int, int], torch.Tensor]:
    """(layer, query position) -> that query's causally masked index scores."""
    table = {}
    for layer, scores in recorded:
        for row in scores:
            table[(layer, int(torch.isfinite(row).sum()) - 1)] = row[torch.isfinite(row)]
    return table


@pytest.mark.parametrize("family", ["deepseek_v32", "kimi_k3"])
def test_engine_dsa_selections_match_reference(family, tiny_checkpoints):
    """Paged DSA indexer scores over the same history select the same top-k sets as the reference."""
    llm = LLM(str(tiny_checkpoints[family]), max_total_tokens=2048, chunked_prefill_size=16, page_size=8)
    model = llm.engine.model
    topk = model.cfg.index_topk
    prompt = _prompts(1, 259, seed=6, lo=50, hi=51)[0]
    recorded: list = []
    for layer in model.model.layers:
        if layer.kind == "dsa":
            layer.self_attn.record_index_scores = recorded
    llm.generate([prompt], _greedy(4), use_tqdm=False)
    engine_rows = _rows_by_query(recorded)
    recorded.clear()
    greedy_generate(model, prompt, 4)
    ref_rows = _rows_by_query(recorded)
    assert engine_rows.keys() == ref_rows.keys()
    compared = 0
    for key, ref_row in ref_rows.items():
        if ref_row.shape[0] <= topk:
            continue
        top = ref_row.topk(topk + 1).values
        if (top[topk - 1] - top[topk]).abs() < 1e-4:
            continue
        assert set(ref_row.topk(topk).indices.tolist()) == set(engine_rows[key].topk(topk).indices.tolist()), key
        compared += 1
    assert compared > 20
