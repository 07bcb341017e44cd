"""`kestrel eval --task vision`: held-out accuracy on the synthetic visual task, per question kind."""

from __future__ import annotations

import random
import re
from collections import defaultdict

from kestrel.chat_template import THINK_END, render_chat
from kestrel.engine.llm import LLM
from kestrel.engine.sampling_params import SamplingParams
from kestrel.train.vision_data import COLORS, KINDS, SHAPES, episode_images, vision_episode

HELD_OUT_SEED = 10_002  # neither the training stream (recipe seed + 1) nor the held-out loss stream (10_001)
_WORD = re.compile(r"[a-z]+|\d+")


def vision_answer(kind: str, text: str):
    """The answer a reply gives: the first colour / shape word, or the last integer, after </think>."""
    words = _WORD.findall(text.split(THINK_END)[-1].lower())
    vocabulary = {"color": COLORS, "shape": SHAPES}.get(kind)
    if vocabulary is not None:
        return next((w for w in words if w in vocabulary), None)
    numbers = [w for w in words if w.isdigit()]
    return int(numbers[-1]) if numbers else None


def eval_vision(llm: LLM, n: int = 200, seed: int = HELD_OUT_SEED, lora_name: str | None = None) -> dict[str, float]:
    """Exact answers on n held-out images (the four kinds in turn), per kind and overall."""
    rng = random.Random(seed)
    cases = [vision_episode(rng, KINDS[i % len(KINDS)]) for i in range(n)]
    prompts, images = [], []
    for ep in cases:
        text = render_chat(ep.messages[:1], None, True, ep.reasoning_effort)
        ids, processed = llm.image_prompt(text, episode_images(ep))
        prompts.append(ids)
        images.append(processed)
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False, images=images, lora_name=lora_name
    )
    right: dict[str, list[bool]] = defaultdict(list)
    for ep, out in zip(cases, outputs):
        kind = ep.meta["image"][0]
        right[kind].append(vision_answer(kind, out.outputs[0].text) == ep.answer)
    scores = {kind: sum(v) / len(v) for kind, v in right.items()}
    scores["all"] = sum(sum(v) for v in right.values()) / n
    return scores
