import math

import pytest
import torch

from kestrel.engine.sampler import PromptLogprob, Sampler, SamplingRow, prompt_logprobs
from kestrel.engine.sampling_params import SamplingParams

# A hand-made distribution over V=8 with distinct probabilities (sums to 1).
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005])
LOGITS = PROBS.log()
V = PROBS.numel()
N_DRAWS = 4000
TOL = 0.03  # > 4 standard deviations of a frequency estimated from 4000 draws


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("n", 0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("presence_penalty", 2.1),
        ("presence_penalty", -3.0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
        ("seed", 1.5),
        ("seed", "42"),
        ("stop", [""]),
        ("logit_bias", {3: 100.5}),
        ("logit_bias", {3: float("nan")}),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_invalid_params_raise_naming_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_defaults_and_normalisation():
    p = SamplingParams(stop="###", temperature=0.0)
    assert p.stop == ["###"]
    assert p.is_greedy
    assert not SamplingParams().is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert "temperature must be >= 0, got -1" in _err(temperature=-1)
    # Boundary values are valid.
    SamplingParams(top_p=1.0, min_p=1.0, top_k=0, logprobs=20, prompt_logprobs=0, seed=0, min_tokens=16)


def _err(**kw) -> str:
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    return str(e.value)


# ----------------------------------------------------------------------------- helpers


def _rows(params: SamplingParams, n: int, output_ids=None) -> list[SamplingRow]:
    return [SamplingRow(params, [], list(output_ids or []), None) for _ in range(n)]


def _frequencies(params: SamplingParams, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    sampler = Sampler(eos_token_ids=[], seed=1234)
    out = sampler.sample(logits.expand(N_DRAWS, -1).clone(), _rows(params, N_DRAWS))
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.numel()).float() / N_DRAWS


def _renorm(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


# ----------------------------------------------------------------------------- sampling


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    out = Sampler([]).sample(logits, _rows(SamplingParams(temperature=0.0), 16))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_ties_take_the_first_maximal_token_and_logits_stay_untouched():
    """Greedy is argmax exactly, ties included (transformers' greedy), and the plain path edits no input."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0], [-1.0, float("nan"), 5.0, 0.0]])
    before = logits.clone()
    out = Sampler([]).sample(logits, _rows(SamplingParams(temperature=0.0), 3))
    assert out.token_ids == logits.argmax(-1).tolist() == [1, 0, 1]
    assert torch.equal(logits, before) or torch.allclose(logits, before, equal_nan=True)


def test_plain_sampling_matches_distribution():
    freq = _frequencies(SamplingParams())
    assert torch.allclose(freq, PROBS, atol=TOL)


def test_top_k():
    freq = _frequencies(SamplingParams(top_k=2))
    assert freq[2:].sum() == 0
    assert torch.allclose(freq, _renorm(PROBS, [0, 1]), atol=TOL)


def test_top_p_keeps_exactly_the_nucleus():
    # cumulative: 0.40, 0.65, 0.80 -> the smallest set reaching 0.7 is the top 3.
    freq = _frequencies(SamplingParams(top_p=0.7))
    assert freq[3:].sum() == 0 and (freq[:3] > 0).all()
    assert torch.allclose(freq, _renorm(PROBS, [0, 1, 2]), atol=TOL)


def test_top_p_tiny_keeps_top_token():
    freq = _frequencies(SamplingParams(top_p=1e-6))
    assert freq[0] == 1.0


def test_top_k_then_top_p():
    # after top_k=3 the renormalised probs are 0.5, 0.3125, 0.1875 -> top_p=0.6 keeps 2.
    freq = _frequencies(SamplingParams(top_k=3, top_p=0.6))
    assert torch.allclose(freq, _renorm(PROBS, [0, 1]), atol=TOL)


def test_min_p():
    # min_p * max_prob = 0.3 * 0.4 = 0.12 -> keeps 0.40, 0.25, 0.15.
    freq = _frequencies(SamplingParams(min_p=0.3))
    assert freq[3:].sum() == 0
    assert torch.allclose(freq, _renorm(PROBS, [0, 1, 2]), atol=TOL)


def test_temperature_sharpens():
    freq = _frequencies(SamplingParams(temperature=0.5))
    expected = torch.softmax(LOGITS / 0.5, dim=-1)
    assert expected[0] > PROBS[0]
    assert torch.allclose(freq, expected, atol=TOL)


def test_mixed_batch_greedy_and_random():
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(min_p=1.0)]
    logits = torch.stack([LOGITS.roll(i) for i in range(3)])
    out = Sampler([]).sample(logits, [SamplingRow(p, [], [], None) for p in params])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_request_is_batch_invariant():
    vocab, steps = 64, 10
    target = SamplingParams(seed=7, temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.5)
    others = [
        SamplingParams(seed=1),
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=99, top_p=0.5),
        SamplingParams(min_p=0.1),
        SamplingParams(seed=7),
        SamplingParams(top_k=5),
    ]
    step_logits = torch.randn(steps, 8, vocab, generator=torch.Generator().manual_seed(3)) * 3

    def run(batch_params: list[SamplingParams], target_pos: int, shared_seed: int) -> list[int]:
        sampler = Sampler(eos_token_ids=[0], seed=shared_seed)
        rows = [SamplingRow(p, [1, 2, 3], [], sampler.make_generator(p, "cpu")) for p in batch_params]
        for s in range(steps):
            logits = step_logits[s, : len(rows)].clone()
            logits[target_pos] = step_logits[s, 0]  # the target always sees the same logits
            out = sampler.sample(logits, rows)
            for row, tok in zip(rows, out.token_ids):
                row.output_ids.append(tok)
        return rows[target_pos].output_ids

    alone = run([target], 0, shared_seed=0)
    assert run([*others[:3], target, *others[3:]], 3, shared_seed=1) == alone
    assert run([target, *others], 0, shared_seed=2) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_unseeded_rows_use_shared_generator_reproducibly():
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(0))
    a = Sampler([], seed=5).sample(logits, _rows(SamplingParams(), 32)).token_ids
    b = Sampler([], seed=5).sample(logits, _rows(SamplingParams(), 32)).token_ids
    assert a == b


def test_make_generator():
    s = Sampler([])
    assert s.make_generator(SamplingParams(), "cpu") is None
    g = s.make_generator(SamplingParams(seed=3), "cpu")
    assert isinstance(g, torch.Generator) and g.initial_seed() == 3


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        Sampler([]).sample(torch.zeros(2, 8), _rows(SamplingParams(), 3))


# ----------------------------------------------------------------------------- penalties, min_tokens


def _processed_logits(sampler: Sampler, logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The logits after min_tokens and penalties (the private steps of Sampler.sample)."""
    from kestrel.engine.sampler import _apply_penalties

    x = logits.clone()[None]
    sampler._apply_min_tokens(x, [row])
    _apply_penalties(x, [row])
    return x[0]


def test_repetition_penalty():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5])
    row = SamplingRow(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1], output_ids=[3, 3], generator=None)
    got = _processed_logits(Sampler([]), logits, row)
    assert torch.allclose(got, torch.tensor([1.0, -4.0, 1.0, -2.0, 0.5]))


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_it_per_row():
    logits = torch.stack([LOGITS, LOGITS, LOGITS])
    rows = [
        SamplingRow(SamplingParams(temperature=0, logit_bias={6: 100}), [0], [], None),
        SamplingRow(SamplingParams(temperature=0, logit_bias={0: -100, 1: -100}), [0], [], None),
        SamplingRow(SamplingParams(temperature=0), [0], [], None),
    ]
    out = Sampler([]).sample(logits, rows)
    assert out.token_ids == [6, 2, 0]
    assert out.logprobs[0] == pytest.approx(math.log(PROBS[6].item()), rel=1e-4)  # logprobs stay the model's


def test_frequency_and_presence_penalties():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # prompt tokens are not penalised by frequency/presence
    row = SamplingRow(params, prompt_ids=[3, 3, 3], output_ids=[0, 0, 0, 1], generator=None)
    got = _processed_logits(Sampler([]), logits, row)
    assert torch.allclose(got, torch.tensor([1.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0, 1.0]))


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    row = SamplingRow(SamplingParams(temperature=0.0, presence_penalty=1.0), [], [0], None)
    assert Sampler([]).sample(logits, [row]).token_ids == [1]


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    sampler = Sampler(eos_token_ids=[0])
    assert sampler.sample(logits, [SamplingRow(params, [], [7], None)]).token_ids == [2]
    # once min_tokens outputs exist, eos is allowed again
    assert sampler.sample(logits, [SamplingRow(params, [], [7, 7], None)]).token_ids == [0]
    # random rows are blocked too
    out = sampler.sample(logits.expand(200, -1).clone(), _rows(SamplingParams(min_tokens=1, stop_token_ids=[1]), 200))
    assert 0 not in out.token_ids and 1 not in out.token_ids


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(3, 30).to(torch.bfloat16)
    params = [
        SamplingParams(logprobs=5, temperature=0.3, top_k=3, repetition_penalty=1.5),
        SamplingParams(logprobs=0),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
    ]
    rows = [SamplingRow(p, [1, 2], [3], None) for p in params]
    out = Sampler([0]).sample(logits, rows)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for i, tok in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[i], raw[i, tok].item(), rel_tol=1e-6)
    vals, idx = raw[0].topk(5)
    assert [t for t, _ in out.top_logprobs[0]] == idx.tolist()
    assert torch.allclose(torch.tensor([lp for _, lp in out.top_logprobs[0]]), vals)
    assert out.top_logprobs[1] == []
    assert out.top_logprobs[2] is None


def test_prompt_logprobs():
    torch.manual_seed(2)
    prompt = [4, 1, 7, 2]
    logits = torch.randn(len(prompt), 10)
    res = prompt_logprobs(logits, prompt, k=3)
    raw = torch.log_softmax(logits, dim=-1)
    assert res[0] is None and len(res) == len(prompt)
    for i in range(1, len(prompt)):
        entry = res[i]
        assert isinstance(entry, PromptLogprob) and entry.token_id == prompt[i]
        assert math.isclose(entry.logprob, raw[i - 1, prompt[i]].item(), rel_tol=1e-6)
        assert [t for t, _ in entry.top] == raw[i - 1].topk(3).indices.tolist()
    assert prompt_logprobs(logits, [], 3) == []
    assert prompt_logprobs(logits[:0], [5], 3) == [None]
    with pytest.raises(ValueError):
        prompt_logprobs(logits[:2], prompt, 3)
