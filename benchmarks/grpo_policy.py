"""The engine the GRPO diagnostics answer with: the mini recipe's base, optionally with an adapter loaded as `policy`.

fp32 and deterministic inference, as the recipe's rollouts run, so a benchmark's answers match what a step samples.
"""

from __future__ import annotations

from kestrel import LLM
from kestrel.train.recipes import RL_RECIPES

POLICY = "policy"  # the adapter's name in the engine (`lora_name=POLICY` answers with it)
MODEL = RL_RECIPES["mini"].model


def policy_llm(lora: str | None, model: str = MODEL) -> LLM:
    """The GRPO base (or another `model`), with the PEFT adapter folder `lora` served as `policy` when given."""
    adapter = {"enable_lora": True, "lora_paths": [f"{POLICY}={lora}"]} if lora else {}
    return LLM(model, dtype="float32", deterministic_inference=True, max_running_requests=256, **adapter)
