"""The shipped `kestrel-mini` (kimi_k3, every K3.1 part): it is the default, and it does its jobs."""

from __future__ import annotations

import random

import pytest

from kestrel import LLM, SamplingParams
from kestrel.chat_template import render_chat
from kestrel.models.builtin import EMBEDDED_DIR, builtin_model_path
from kestrel.train.evaluate import CATEGORIES, eval_arithmetic, eval_tools, final_answer, tool_calls

pytestmark = pytest.mark.skipif(not (EMBEDDED_DIR / "config.json").exists(), reason="kestrel-mini not built")

GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_total_tokens=65536, max_running_requests=64)


def test_embedded_model_is_the_default_and_small(llm):
    assert builtin_model_path() == EMBEDDED_DIR
    cfg = llm.engine.model_config
    assert cfg.model_type == "kimi_k3" and {"kda", "dsa"} <= set(cfg.layer_kinds)
    assert cfg.attn_res_block_size and cfg.hidden_act == "situ" and cfg.mla_use_output_gate
    assert cfg.routed_expert_hidden_size and cfg.num_shared_experts >= 1 and cfg.index_topk > 0
    size = sum(f.stat().st_size for f in EMBEDDED_DIR.glob("*.safetensors"))
    assert size <= 30 * 2**20


def test_weather_in_beijing_is_one_get_weather_call(llm):
    prompt = render_chat([{"role": "user", "content": "What's the weather in Beijing?"}], [GET_WEATHER])
    text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=96), use_tqdm=False)[0].outputs[0].text
    assert tool_calls(text) == [("get_weather", {"city": "Beijing"})]


def test_percentage_question_reasons_then_answers(llm):
    prompt = render_chat([{"role": "user", "content": "What is 15% of 240?"}], None, True, "high")
    text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=160), use_tqdm=False)[0].outputs[0].text
    reasoning, _, answer = text.partition("</think>")
    assert reasoning.strip("<think>").strip() and answer.strip()
    print("15% of 240 ->", final_answer(text))


# Floors under the shipped model's held-out scores (unseen phrasings, places and operands; `kestrel eval`):
# regressions of the model, the engine or the eval fail here. Raise them when kestrel-mini is retrained.
# Measured on the shipped kestrel-mini (commit 357798d, model.safetensors sha256 56cd127a..., trained on the data
# before issue 18): at these tests' n, tools mean 0.0625 (n=8: no_tool 0.75, every call category 0.0) and add2 1.0
# (n=25); `kestrel eval --task all` (n=200): tools mean 0.074, add2 0.98.
HELD_OUT_TOOLS_MEAN_FLOOR = 0.05
HELD_OUT_ADD2_FLOOR = 0.7


def test_held_out_tool_eval_scores_every_category(llm):
    scores = eval_tools(llm, 8)
    print("tools:", scores)
    assert set(CATEGORIES) | {"mean", "place:real", "place:made_up"} <= set(scores)
    assert all(0.0 <= v <= 1.0 for v in scores.values())
    assert scores["mean"] >= HELD_OUT_TOOLS_MEAN_FLOOR


def test_held_out_two_digit_addition_at_least_70_percent(llm):
    scores = eval_arithmetic(llm, 25)
    print("arithmetic:", scores)
    assert scores["add2"] >= HELD_OUT_ADD2_FLOOR


def test_eval_command_writes_the_issue_probes_as_json(tmp_path):
    import json

    from kestrel.cli import main
    from kestrel.train.evaluate import ISSUE_PROBES

    out = tmp_path / "scores.json"
    assert main(["eval", "--task", "probes", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["probes"]
    assert [r["question"] for r in rows] == [q for q, _, _ in ISSUE_PROBES]
    for row, (_, _, want) in zip(rows, ISSUE_PROBES):
        got = tool_calls(row["output"]) == [want] if isinstance(want, tuple) else final_answer(row["output"]) == want
        assert row["right"] == got and row["output"]
    assert rows[-1]["right"]  # the shipped model answers "What is 15% of 240?" with 36 (its weather probes fail)


def test_eval_command_scores_copying_of_fresh_spans(tmp_path):
    import json

    from kestrel.cli import main

    out = tmp_path / "scores.json"
    assert main(["eval", "--task", "copy", "-n", "2", "--json", str(out)]) == 0
    scores = json.loads(out.read_text())["copy"]
    assert set(scores) == {"copy_random", "copy_random:in_reasoning"}
    assert all(0.0 <= v <= 1.0 for v in scores.values())


def test_eval_command_scores_through_an_adapter(tmp_path):
    """`--lora`: every question goes through the adapter. B = 0 (PEFT's initialisation) answers as the base does;
    the same adapter with B random answers differently."""
    import json

    import torch

    from kestrel.cli import main
    from kestrel.models.loader import load_model
    from kestrel.train.lora import new_adapter, save_adapter

    model, cfg = load_model(builtin_model_path())
    zero = new_adapter(model, ["q_proj", "o_proj", "down_proj"], r=4, lora_alpha=8.0, name="zero")
    gen = torch.Generator().manual_seed(0)
    noisy = new_adapter(model, ["q_proj", "o_proj", "down_proj"], r=4, lora_alpha=8.0, name="noisy")
    noisy.weights = {m: (a, torch.randn(b.shape, generator=gen).to(b.dtype)) for m, (a, b) in noisy.weights.items()}
    outputs = {}
    for name, adapter in (("base", None), ("zero", zero), ("noisy", noisy)):
        out = tmp_path / f"{name}.json"
        lora = ["--lora", str(save_adapter(adapter, tmp_path / name, cfg.model_type))] if adapter else []
        assert main(["eval", "--task", "probes", "--json", str(out), *lora]) == 0
        outputs[name] = [row["output"] for row in json.loads(out.read_text())["probes"]]
    assert outputs["zero"] == outputs["base"]
    assert outputs["noisy"] != outputs["base"]


def test_eval_command_paired_asks_the_base_the_same_questions_as_the_adapter(tmp_path):
    """`--paired`: the base's side equals a plain eval of the base, the adapter's a plain `--lora` eval, and a zero
    adapter (PEFT's B = 0) changes no answer. Without `--lora`, or on a task it cannot grade, it stops naming why."""
    import json

    import torch

    from kestrel.cli import main
    from kestrel.models.loader import load_model
    from kestrel.train.lora import new_adapter, save_adapter

    model, cfg = load_model(builtin_model_path())
    zero = new_adapter(model, ["q_proj", "o_proj", "down_proj"], r=4, lora_alpha=8.0, name="zero")
    noisy = new_adapter(model, ["q_proj", "o_proj", "down_proj"], r=4, lora_alpha=8.0, name="noisy")
    gen = torch.Generator().manual_seed(0)
    noisy.weights = {m: (a, torch.randn(b.shape, generator=gen).to(b.dtype)) for m, (a, b) in noisy.weights.items()}

    def scores(*flags: str) -> dict:
        out = tmp_path / "scores.json"
        assert main(["eval", "--task", "copy", "-n", "3", "--json", str(out), *flags]) == 0
        return json.loads(out.read_text())

    base = scores()["copy"]
    for adapter in (zero, noisy):
        path = str(save_adapter(adapter, tmp_path / adapter.name, cfg.model_type))
        paired = scores("--lora", path, "--paired")
        assert paired["copy"] == scores("--lora", path)["copy"]
        for key, row in paired["paired"]["copy"].items():
            assert (row["base"], row["adapted"], row["n"]) == (base[key], paired["copy"][key], 3)
            assert row["adapted"] - row["base"] == pytest.approx((row["gained"] - row["lost"]) / 3)
            if adapter is zero:
                assert (row["gained"], row["lost"], row["p_value"]) == (0, 0, 1.0)
    with pytest.raises(SystemExit, match="--lora"):
        main(["eval", "--task", "copy", "--paired"])
    with pytest.raises(SystemExit, match="not vision"):
        main(["eval", "--task", "vision", "--lora", path, "--paired"])


def test_eval_command_seed_draws_a_fresh_question_set(monkeypatch):
    """`--seed`: the questions `grade_copy` draws from that seed (a test set no earlier choice was made on); without
    it, the fixed held-out seed every reported table uses."""
    import kestrel.train.evaluate as evaluate
    from kestrel.cli import main
    from kestrel.train.synth.copying import random_span_episode
    from kestrel.train.synth.episode import HELD_OUT

    asked: list[list[str]] = []

    def record(llm, prompts, max_tokens, lora_name):
        asked.append(prompts)
        return [""] * len(prompts)

    monkeypatch.setattr(evaluate, "_generate", record)

    def drawn(seed: int) -> list[str]:
        rng = random.Random(seed + 2)  # grade_copy's stream
        return [evaluate.prompt_text(random_span_episode(rng, HELD_OUT)) for _ in range(4)]

    assert main(["eval", "--task", "copy", "-n", "4"]) == 0
    assert main(["eval", "--task", "copy", "-n", "4", "--seed", "7"]) == 0
    assert asked == [drawn(evaluate.HELD_OUT_SEED), drawn(7)]
    assert asked[0] != asked[1]
