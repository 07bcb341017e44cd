"""A synthetic visual task rendered with Pillow: coloured shapes and short numbers on varied backgrounds.

Four questions about one 112x112 image (16 placeholder tokens with a 2x2-merging 14-px tower):

    color   "What color is the circle?"       a circle among up to two shapes of other colours
    shape   "What shape is this?"             one circle, square, triangle or star
    count   "How many triangles are there?"   1-4 triangles among up to two other shapes
    number  "What number is written here?"   0-99 in one of a few fonts and sizes

Episodes carry no pixels: `meta["image"]` is (kind, seed) and `render_image` draws it on demand, so a training set
of tens of thousands of episodes costs nothing until a batch needs it. Backgrounds (flat pastels, gradients, noise,
stripes) never use the shape colours.
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from kestrel.train.data import Episode

IMAGE_SIZE = 112
COLORS = {
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (31, 90, 220),
    "yellow": (240, 200, 20),
    "purple": (148, 60, 189),
    "orange": (255, 127, 14),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "star")
KINDS = ("color", "shape", "count", "number")
NUMBER_WORDS = ["zero", "one", "two", "three", "four"]
QUESTIONS = {
    "color": ["What color is the circle?", "What colour is the circle?", "Which color does the circle have?"],
    "shape": ["What shape is this?", "What shape do you see?", "Which shape is in the picture?"],
    "count": ["How many triangles are there?", "How many triangles do you see?", "Count the triangles."],
    "number": ["What number is written here?", "What number do you see?", "Read the number in the image."],
}


def _background(rng: random.Random) -> Image.Image:
    """Light, low-saturation backgrounds: flat, a vertical gradient, pixel noise or stripes."""
    base = np.array([rng.randint(175, 250) for _ in range(3)], dtype=np.float32)
    style = rng.choice(["flat", "gradient", "noise", "stripes"])
    if style == "flat":
        arr = np.broadcast_to(base, (IMAGE_SIZE, IMAGE_SIZE, 3)).copy()
    elif style == "gradient":
        other = np.array([rng.randint(175, 250) for _ in range(3)], dtype=np.float32)
        t = np.linspace(0, 1, IMAGE_SIZE, dtype=np.float32)[:, None, None]
        arr = np.broadcast_to(base * (1 - t) + other * t, (IMAGE_SIZE, IMAGE_SIZE, 3)).copy()
    elif style == "noise":
        noise = np.random.default_rng(rng.randrange(1 << 30)).normal(0, 12, (IMAGE_SIZE, IMAGE_SIZE, 3))
        arr = base + noise
    else:
        period = rng.randint(6, 16)
        stripe = (np.arange(IMAGE_SIZE) // period % 2).astype(np.float32)[None, :, None] * 18
        arr = np.broadcast_to(base - stripe, (IMAGE_SIZE, IMAGE_SIZE, 3)).copy()
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _polygon(shape: str, cx: float, cy: float, r: float, rng: random.Random) -> list[tuple[float, float]] | None:
    import math

    turn = rng.uniform(-0.25, 0.25)
    if shape == "square":
        return [(cx + r * math.cos(turn + a), cy + r * math.sin(turn + a)) for a in (0.785, 2.356, 3.927, 5.498)]
    if shape == "triangle":
        return [(cx + r * math.cos(turn + a), cy + r * math.sin(turn + a)) for a in (-1.571, 0.524, 2.618)]
    if shape == "star":
        pts = []
        for i in range(10):
            rad = r if i % 2 == 0 else r * 0.45
            a = turn - 1.571 + i * math.pi / 5
            pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        return pts
    return None


def _draw(draw: ImageDraw.ImageDraw, shape: str, box: tuple[float, float, float], color, rng: random.Random) -> None:
    cx, cy, r = box
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    else:
        draw.polygon(_polygon(shape, cx, cy, r, rng), fill=color)


def _places(rng: random.Random, n: int, r_lo: int, r_hi: int) -> list[tuple[float, float, float]]:
    """n non-overlapping (cx, cy, r) inside the image."""
    out: list[tuple[float, float, float]] = []
    while len(out) < n:
        r = rng.randint(r_lo, r_hi)
        cx, cy = rng.uniform(r + 2, IMAGE_SIZE - r - 2), rng.uniform(r + 2, IMAGE_SIZE - r - 2)
        if all((cx - x) ** 2 + (cy - y) ** 2 > (r + q + 4) ** 2 for x, y, q in out):
            out.append((cx, cy, r))
        elif len(out) and rng.random() < 0.01:
            out = []  # a crowded layout: start over
    return out


def _font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def render_image(kind: str, seed: int) -> tuple[Image.Image, object]:
    """The image of a (kind, seed) and its answer: a colour name, a shape name, a count or a number."""
    rng = random.Random(f"{kind}:{seed}")
    image = _background(rng)
    draw = ImageDraw.Draw(image)
    if kind == "number":
        value = rng.randint(0, 99)
        font = _font(rng.randint(40, 60))
        text = str(value)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        x = rng.uniform(2, max(2, IMAGE_SIZE - (right - left) - 2)) - left
        y = rng.uniform(2, max(2, IMAGE_SIZE - (bottom - top) - 2)) - top
        color = COLORS[rng.choice(["black", "blue", "red", "purple"])]
        draw.text((x, y), text, fill=color, font=font)
        return image, value
    if kind == "shape":
        shape = rng.choice(SHAPES)
        _draw(draw, shape, _places(rng, 1, 22, 40)[0], COLORS[rng.choice(list(COLORS))], rng)
        return image, shape
    if kind == "color":
        color = rng.choice(list(COLORS))
        others = rng.sample([c for c in COLORS if c != color], rng.randint(0, 2))
        places = _places(rng, 1 + len(others), 13, 22)
        _draw(draw, "circle", places[0], COLORS[color], rng)
        for place, other in zip(places[1:], others):
            _draw(draw, rng.choice(["square", "triangle", "star"]), place, COLORS[other], rng)
        return image, color
    if kind == "count":
        n = rng.randint(1, 4)
        extra = rng.randint(0, 2)
        places = _places(rng, n + extra, 10, 16)
        for place in places[:n]:
            _draw(draw, "triangle", place, COLORS[rng.choice(list(COLORS))], rng)
        for place in places[n:]:
            _draw(draw, rng.choice(["circle", "square"]), place, COLORS[rng.choice(list(COLORS))], rng)
        return image, n
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


REPLY_STYLES = ("worked", "short")


def _reply(kind: str, answer, style: str = "worked") -> tuple[str, str]:
    """(reasoning, answer text) of the assistant turn. "worked" spells out what was looked at; "short" is the
    embedded kestrel-mini's own reply shape (`<think>The answer is X.</think>The answer is X.`), what a frozen
    text model already writes, so that a tower trained against it only has to supply X."""
    if style == "short":
        return f"The answer is {answer}.", f"The answer is {answer}."
    if style != "worked":
        raise ValueError(f"style must be one of {REPLY_STYLES}, got {style!r}")
    if kind == "color":
        return "I look at the circle.", f"The circle is {answer}."
    if kind == "shape":
        return "I look at the shape.", f"It is a {answer}."
    if kind == "count":
        word = "triangle" if answer == 1 else "triangles"
        verb = "is" if answer == 1 else "are"
        return f"I count the triangles: {NUMBER_WORDS[answer]}.", f"There {verb} {answer} {word}."
    digits = " ".join(str(answer))
    return f"I read the digits: {digits}.", f"The number is {answer}."


def vision_episode(rng: random.Random, kind: str | None = None, style: str = "worked") -> Episode:
    kind = kind or rng.choice(KINDS)
    seed = rng.randrange(1 << 40)
    _, answer = render_image(kind, seed)
    question = rng.choice(QUESTIONS[kind])
    reasoning, reply = _reply(kind, answer, style)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
        {"role": "assistant", "reasoning_content": reasoning, "content": reply},
    ]
    return Episode("vision", messages, None, rng.choice([None, "low", "high"]), answer, {"image": (kind, seed)})


def vision_episodes(seed: int, n: int, style: str = "worked", kinds: tuple[str, ...] = KINDS) -> list[Episode]:
    """n episodes, the kinds of `kinds` in turn (a kind named twice gets twice the share); same seed, same list
    (and same images)."""
    if unknown := sorted(set(kinds) - set(KINDS)):
        raise ValueError(f"kinds: {unknown} are not among {KINDS}")
    rng = random.Random(seed)
    return [vision_episode(rng, kinds[i % len(kinds)], style) for i in range(n)]


def episode_images(ep: Episode) -> list[Image.Image]:
    """The images of an episode, drawn now (none for text episodes)."""
    spec = ep.meta.get("image")
    return [render_image(*spec)[0]] if spec is not None else []
