"""kestrel-mini sees: the openai client sends held-out images to `kestrel serve` (the embedded model) and gets the
right answers; the shipped tower and vision adapter leave its text answers as they were."""

from __future__ import annotations

import base64
import io
import random

import openai
import pytest
from server_harness import running_server

from kestrel.engine.vision_adapter import VISION_ADAPTER
from kestrel.models.builtin import EMBEDDED_DIR
from kestrel.train.vision_data import KINDS, QUESTIONS, render_image
from kestrel.train.vision_eval import HELD_OUT_SEED, vision_answer

pytestmark = pytest.mark.skipif(not (EMBEDDED_DIR / "config.json").exists(), reason="kestrel-mini not built")


def _data_url(kind: str, seed: int) -> tuple[str, object]:
    image, answer = render_image(kind, seed)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), answer


def test_openai_client_gets_right_answers_about_held_out_images_from_the_embedded_model():
    rng = random.Random(HELD_OUT_SEED + 7)  # images the training streams never drew
    cases = [(kind, rng.randrange(1 << 40), rng.choice(QUESTIONS[kind])) for kind in KINDS for _ in range(3)]
    with running_server(None) as (url, name):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        cards = {card.id for card in client.models.list().data}
        assert VISION_ADAPTER in cards  # served beside the base, applied to image requests by default
        right = []
        for kind, seed, question in cases:
            data_url, answer = _data_url(kind, seed)
            resp = client.chat.completions.create(
                model=name,
                max_tokens=48,
                temperature=0,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": data_url}},
                            {"type": "text", "text": question},
                        ],
                    }
                ],
            )
            message = resp.choices[0].message
            right.append(vision_answer(kind, message.content or "") == answer)
        text = client.chat.completions.create(
            model=name, max_tokens=128, temperature=0, messages=[{"role": "user", "content": "What is 7 + 5?"}]
        )
    # Chance is about 1/7 for colours, 1/4 for shapes and counts, 1/100 for numbers.
    assert sum(right) >= 10, right
    assert "12" in (text.choices[0].message.content or "")
