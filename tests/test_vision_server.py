"""`kestrel serve` with a vision model: OpenAI `image_url` parts from base64 data URLs, a loopback HTTP server and
an allowed local folder give the engine's own answer; bad images are 400s with an OpenAI error body; nothing leaks."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from server_harness import running_server
from test_server import assert_openai_error, wait_idle
from test_vision_model import png_header_only

from kestrel import LLM, SamplingParams
from kestrel.chat_template import render_chat
from kestrel.models.checkpoint import make_model
from kestrel.server.chat import TOOL_MARKERS

MAX_IMAGE_BYTES = 200_000


def _png(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


class _Files(http.server.BaseHTTPRequestHandler):
    """Loopback image host: /pic.png, /huge.png (past the byte limit), /slow.png (never finishes in time)."""

    pictures: dict[str, bytes] = {}

    def do_GET(self):  # noqa: N802
        if self.path == "/slow.png":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):
                time.sleep(0.1)
                try:
                    self.wfile.write(b"\0" * 10)
                except OSError:
                    return
            return
        body = self.pictures.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    _Files.pictures = {"/pic.png": _png(84, 112, 1), "/huge.png": b"\0" * (MAX_IMAGE_BYTES + 10)}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_model("kimi_k3", "tiny", tmp_path_factory.mktemp("vision_server"), seed=11, vision="tiny"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "pic.png").write_bytes(_png(84, 112, 1))
    return root


@pytest.fixture(scope="module")
def server(checkpoint, media_dir):
    limits = dict(allowed_local_media_path=str(media_dir), max_image_bytes=MAX_IMAGE_BYTES, media_fetch_timeout=1.5)
    with running_server(checkpoint, max_request_bytes=1 << 20, **limits) as s:
        yield s


@pytest.fixture(scope="module")
def http_client(server):
    with httpx.Client(base_url=server[0], timeout=60) as client:
        yield client


def _body(name: str, urls: list[str], text: str = "What is in the picture?") -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return {"model": name, "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}


def test_models_card_says_the_model_takes_images(http_client):
    card = http_client.get("/v1/models").json()["data"][0]
    assert card["input_modalities"] == ["text", "image"]


def test_openai_client_image_gets_the_engines_own_answer_from_every_source(
    server, checkpoint, image_host, media_dir, http_client
):
    url, name = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    picture = _png(84, 112, 1)
    answers = {}
    for source in (_data_url(picture), f"{image_host}/pic.png", f"file://{media_dir / 'pic.png'}"):
        resp = client.chat.completions.create(
            **_body(name, [source]), logprobs=True, extra_body={"reasoning_effort": "low"}
        )
        entries = resp.choices[0].logprobs.content
        answers[source[:4]] = (
            [bytes(e.bytes) for e in entries],
            [e.logprob for e in entries],
            resp.usage.prompt_tokens,
        )
    offline = LLM(checkpoint, max_total_tokens=4096)
    content = [{"type": "image_url"}, {"type": "text", "text": "What is in the picture?"}]
    ids, images = offline.image_prompt(
        render_chat([{"role": "user", "content": content}], reasoning_effort="low"),
        [Image.open(io.BytesIO(picture))],
    )
    tok = offline.tokenizer
    bans = {tok.token_to_id(m): -100.0 for m in TOOL_MARKERS}  # the server bans tool markers when no tools
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, logit_bias=bans)
    expected = offline.generate([ids], params, use_tqdm=False, images=[images])[0].outputs[0]
    expected_bytes = [tok.decode([t], skip_special_tokens=False).encode() for t in expected.token_ids]
    assert set(answers) == {"data", "http", "file"}
    for token_bytes, logprobs, prompt_tokens in answers.values():
        assert prompt_tokens == len(ids)  # 12 placeholders, not one
        assert len(token_bytes) == len(expected.token_ids) == 6
        assert logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        assert all(b == e or "\ufffd" in e.decode() for b, e in zip(token_bytes, expected_bytes))
    assert wait_idle(http_client)["kestrel_kv_pages_used"] == 0


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("truncated_base64", "base64"),
        ("text_file", "not a decodable image"),
        ("huge_image", "pixels"),
        ("too_many_images", "at most 16 per request"),
        ("outside_local_folder", "outside --allowed-local-media-path"),
        ("download_too_large", "more than the 200000 accepted"),
        ("download_too_slow", "longer than 1.5 s"),
        ("http_404", "HTTP 404"),
        ("truncated_png", "truncated or corrupt"),
    ],
)
def test_bad_images_are_400s_with_an_openai_error_and_leak_nothing(server, http_client, image_host, case, needle):
    _, name = server
    good = _data_url(_png(28, 28, 2))
    urls = {
        "truncated_base64": [_data_url(_png(56, 56, 3))[:-7]],
        "text_file": [_data_url(b"just some text, not an image\n", "text/plain")],
        "huge_image": [_data_url(png_header_only(20000, 20000))],
        "too_many_images": [good] * 100,
        "outside_local_folder": ["file:///etc/hostname"],
        "download_too_large": [f"{image_host}/huge.png"],
        "download_too_slow": [f"{image_host}/slow.png"],
        "http_404": [f"{image_host}/missing.png"],
        "truncated_png": [good, _data_url(_png(56, 56, 4)[:120])],
    }[case]
    r = http_client.post("/v1/chat/completions", json=_body(name, urls))
    param = "messages" if case == "too_many_images" else f"messages[0].content[{len(urls) - 1}]"
    err = assert_openai_error(r, 400, param)
    assert needle in err["message"]
    m = wait_idle(http_client)
    assert m["kestrel_num_running_requests"] == 0 and m["kestrel_kv_pages_used"] == 0


def test_placeholder_text_without_an_image_is_a_400(server, http_client):
    _, name = server
    body = _body(name, [_data_url(_png(56, 56, 5))], text="and <|media_pad|> in my text")
    assert (
        "image placeholders" in assert_openai_error(http_client.post("/v1/chat/completions", json=body), 400)["message"]
    )
