"""What every generating endpoint shares: the serving context, admission checks, and one request's engine work."""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from tokenizers import decoders

from kestrel.disagg.role import BootstrapTarget
from kestrel.engine.outputs import RequestOutput
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.vision.preprocess import ProcessedImage
from kestrel.server.async_engine import AsyncEngine
from kestrel.server.engine_events import EngineStopped, NeverFits, QueueFull, StreamEvent
from kestrel.server.errors import APIError, ClientDisconnected
from kestrel.server.media import MediaLoader
from kestrel.server.protocol import ResponseFormat
from kestrel.tokenizer import BYTE_LEVEL

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's, when the router names a prefill without one
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
RETRY_AFTER_S = 1


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_name: str
    reasoning_parser: str | None = "kimi"  # None: reasoning stays in `content`
    tool_call_parser: str | None = "kimi_k2"  # None: tool calls stay in `content`
    media: MediaLoader | None = None  # None: the model takes no images
    max_images: int = 0  # images per request (--limit-mm-per-prompt)

    async def load_images(self, parts: list[tuple[str, str]], ids: list[int]) -> list[ProcessedImage]:
        """Fetch, size-check, decode and preprocess every image part at once (400 naming the first bad part)."""
        marker = self.media.vision.image_token_id
        if ids.count(marker) != len(parts):  # the template wrote one per image part; text wrote more
            msg = f"messages: {ids.count(marker)} image placeholders for {len(parts)} images (text may not hold them)"
            raise APIError(400, msg, param="messages")
        results = await asyncio.gather(*(self.media.load(url, param) for param, url in parts), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (None: the base model); 404 for a name that is neither."""
        if model is None or model == self.model_name:
            return None
        if model in self.engine.lora_adapters:
            return model
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def response_model(self, model: str | None) -> str:
        """The `model` a response names: the adapter the request chose by name, else the served model (as vLLM
        echoes it, so a client sees which adapter answered)."""
        return self.check_model(model) or self.model_name

    def check_lora(self, name: str | None, param: str = "lora_path") -> str | None:
        if name is not None and name not in self.engine.lora_adapters:
            loaded = ", ".join(sorted(self.engine.lora_adapters)) or "none"
            raise APIError(400, f"{param}: adapter {name!r} is not loaded (loaded: {loaded})", param=param)
        return name

    def check_prompt_len(self, num_tokens: int, param: str) -> None:
        if num_tokens == 0:
            raise APIError(400, f"{param}: the prompt must contain at least one token", param=param)
        limit = self.engine.max_model_len
        if num_tokens >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, and the prompt has {num_tokens} tokens "
                f"(at most {limit - 1} leave room for one generated token).",
                param=param,
                code="context_length_exceeded",
            )

    def check_context(self, num_prompt_tokens: int, max_tokens: int, param: str) -> None:
        """The prompt and `max_tokens` must both fit (as vLLM): the engine would silently cut `max_tokens` short."""
        limit, total = self.engine.max_model_len, num_prompt_tokens + max_tokens
        if total > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested {total} tokens "
                f"({num_prompt_tokens} in the prompt, {max_tokens} in {param}). "
                f"Please reduce the length of the prompt or {param}.",
                param=param,
                code="context_length_exceeded",
            )

    async def encode(self, text: str, param: str) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, f"{param}: this model has no tokenizer; send token ids", param=param)
        return await run_in_threadpool(lambda: tok.encode(text).ids)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{param}: token ids must be in [0, {vocab})", param=param)

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        return self.engine.max_model_len - num_prompt_tokens

    def bootstrap_targets(self, body, num_prompts: int) -> list[BootstrapTarget | None]:
        """SGLang's `bootstrap_host/port/room` (one value, or one per prompt) on a disaggregated worker; a
        worker serving both halves ignores them (None per prompt)."""
        if self.engine.engine_config.disaggregation_mode == "null" or body.bootstrap_room is None:
            return [None] * num_prompts

        def per_prompt(value, name: str) -> list:
            values = value if isinstance(value, list) else [value] * num_prompts
            if len(values) != num_prompts:
                msg = f"{name}: {len(values)} values for {num_prompts} prompt(s) (one bootstrap room per sequence)"
                raise APIError(400, msg, param=name)
            return values

        rooms = per_prompt(body.bootstrap_room, "bootstrap_room")
        if body.bootstrap_host is None:
            raise APIError(400, "bootstrap_host: required with bootstrap_room", param="bootstrap_host")
        hosts = per_prompt(body.bootstrap_host, "bootstrap_host")
        ports = per_prompt(body.bootstrap_port, "bootstrap_port")
        if any(not 0 <= r < 1 << 63 for r in rooms):
            raise APIError(400, "bootstrap_room: must be in [0, 2^63)", param="bootstrap_room")
        return [
            BootstrapTarget(h, DEFAULT_BOOTSTRAP_PORT if p is None else p, r)
            for h, p, r in zip(hosts, ports, rooms, strict=True)
        ]

    async def compile_grammar(self, fmt: ResponseFormat | None) -> CompiledGrammar | None:
        """The grammar `response_format` asks for (None for text), compiled on a worker thread: a new schema takes
        milliseconds to seconds, which the event loop and the engine thread must not wait for."""
        if fmt is None or fmt.type == "text":
            return None
        spec = fmt.json_schema
        schema = spec.schema_ if spec is not None and spec.schema_ is not None else {"type": "object"}
        strict = spec is None or spec.strict is not False  # OpenAI's strict:false still gets valid JSON
        # The compiler belongs to the engine (one per model, its cache shared by all requests); it only reads
        # read-only engine facts, so any thread may use it.
        engine = self.engine
        try:
            return await asyncio.to_thread(lambda: engine.grammar().compile(fmt.type, schema, strict))
        except ValueError as exc:
            raise APIError(400, f"response_format: {exc}", param="response_format") from None

    async def compile_tool_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> CompiledGrammar:
        """The grammar a forced `tool_choice` asks for: a tool-call section calling only `tools`."""
        engine = self.engine
        try:
            return await asyncio.to_thread(lambda: engine.grammar().compile_tool_calls(tools, parallel))
        except ValueError as exc:
            raise APIError(400, f"tools: {exc}", param="tools") from None


def sampling_error(exc: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """`SamplingParams`' ValueError ("top_p must be in (0, 1], got 2") → 400 whose param is the field it names."""
    match = re.match(r"(\w+)", str(exc))
    param = match.group(1) if match else None
    param = (renames or {}).get(param, param)
    message = str(exc) if param is None else re.sub(r"^\w+", param, str(exc))
    return APIError(400, message, param=param)


def make_params(build, renames: dict[str, str] | None = None) -> SamplingParams:
    try:
        return build()
    except ValueError as exc:
        raise sampling_error(exc, renames) from None


def event_error(event: StreamEvent) -> APIError | None:
    if event.error is not None:
        return APIError(event.status, event.error)
    if event.output is not None:
        for out in event.output.outputs:
            if out.error:
                return APIError(out.error_status, out.error)
    return None


class Generation:
    """One HTTP request's engine work: a request group per prompt, all reporting on one queue.

    Whoever creates it must `close()` it (in a `finally`): that aborts whatever has not finished, which is how a
    disconnected client, a cancelled handler or a shutdown frees pages and state slots at once.
    """

    def __init__(
        self,
        ctx: ServingContext,
        request_ids: list[str],
        prompts: list[list[int]],
        params: SamplingParams,
        deltas: bool,
        routed_experts: bool = False,
        loras: list[str | None] | None = None,
        restartable: bool = False,
        bootstraps: list[BootstrapTarget | None] | None = None,
        images: list[list[ProcessedImage] | None] | None = None,
        indexer_topk: bool = False,
    ) -> None:
        self.engine = ctx.engine
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.pending: set[str] = set()
        try:
            self.engine.admit(len(prompts), params.n)
            for i, (rid, ids) in enumerate(zip(request_ids, prompts)):
                lora = loras[i] if loras else None
                boot = bootstraps[i] if bootstraps else None
                ims = images[i] if images else None
                self.engine.submit(
                    ids,
                    params,
                    rid,
                    deltas=deltas,
                    routed_experts=routed_experts,
                    events=self.queue,
                    lora=lora,
                    restartable=restartable,
                    bootstrap=boot,
                    images=ims,
                    indexer_topk=indexer_topk,
                )
                self.pending.add(rid)
        except QueueFull as exc:
            self.close()
            raise APIError(503, f"server busy: {exc}", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except NeverFits as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        except EngineStopped as exc:
            self.close()
            raise APIError(503, str(exc)) from None
        except ValueError as exc:
            self.close()
            raise APIError(400, str(exc)) from None

    @property
    def finished(self) -> bool:
        return not self.pending

    async def next(self, client: HTTPRequest | None = None) -> StreamEvent:
        """The next event; with `client`, poll it while waiting (a non-streaming response has no other way to
        notice a disconnect) and raise ClientDisconnected when it is gone."""
        while True:
            if client is None:
                event = await self.queue.get()
            else:
                try:
                    event = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await client.is_disconnected():
                        self.close()
                        raise ClientDisconnected() from None
                    continue
            if event.done:
                self.pending.discard(event.request_id)
            return event

    async def outputs(self, client: HTTPRequest) -> list[RequestOutput]:
        """Wait for every group to finish (non-streaming); outputs in prompt order."""
        done: dict[str, RequestOutput] = {}
        while not self.finished:
            event = await self.next(client)
            err = event_error(event)
            if err is not None:
                raise err
            if event.output is not None:
                done[event.request_id] = event.output
        return [done[rid] for rid in sorted(done, key=self.index.__getitem__)]

    def close(self) -> None:
        for rid in self.pending:
            self.engine.abort(rid)
        self.pending.clear()


class SSEResponse(StreamingResponse):
    """Server-sent events whose engine work is aborted however the response ends: a client that disconnects
    before the first chunk is sent cancels the body before its generator ever runs, so a `finally` inside the
    generator is not enough."""

    def __init__(self, content, gen: Generation) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()


def usage(prompt_tokens: int, outputs: list[RequestOutput]) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    cached = sum(max((c.cached_tokens for c in out.outputs), default=0) for out in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


LOGPROB_FLOOR = -9999.0  # vLLM's floor for OpenAI logprobs: the schema's `logprob` is a number, never null


def json_float(x: float) -> float | None:
    """A logprob as SGLang's /generate sends it: NaN or ±inf (a diverged model's logits) become null instead of
    failing the whole response with an encoding error."""
    return x if math.isfinite(x) else None


def openai_logprob(x: float) -> float:
    """A logprob as OpenAI clients parse it: -inf or NaN (a diverged model's logits) become the floor instead of
    failing the response with an encoding error or a client-side validation error."""
    return x if math.isfinite(x) else LOGPROB_FLOOR


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte tokens


class TokenText:
    """Token id → the text OpenAI's logprob entries show for it, and its raw bytes (memoised; per id)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._added = set(tokenizer.get_added_tokens_decoder()) if tokenizer else set()
        self._byte_level = tokenizer is not None and isinstance(tokenizer.decoder, decoders.ByteLevel)

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: a byte-level token that is part of a UTF-8 sequence decodes to U+FFFD alone."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = list(self._raw_bytes(token_id))
            self._bytes[token_id] = raw
        return raw

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id) if self._tok and token_id not in self._added else None
        if piece is None:
            return self(token_id).encode()
        if self._byte_level and all(ch in BYTE_LEVEL for ch in piece):
            return bytes(BYTE_LEVEL[ch] for ch in piece)
        match = _BYTE_FALLBACK.match(piece)
        return bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode()

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False) if self._tok else str(token_id)
            self._cache[token_id] = text
        return text
