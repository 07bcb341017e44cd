"""`POST /v1/chat/completions`: the Kimi chat template in; reasoning, content and tool calls out.

Streaming and non-streaming responses run the same parsers over the same text (the non-streaming one all at once),
so the concatenated stream deltas equal the non-streamed message.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request as HTTPRequest

from kestrel.chat_template import (
    CALL_ARGS,
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    REASONING_EFFORTS,
    THINK_BEGIN,
    render_chat,
)
from kestrel.engine.outputs import RequestOutput
from kestrel.models.vision.inputs import expand_placeholders
from kestrel.server.engine_events import SeqDelta
from kestrel.server.errors import APIError, error_body
from kestrel.server.protocol import ChatCompletionRequest, ImagePart, MediaPart
from kestrel.server.reasoning import ReasoningParser
from kestrel.server.serving import (
    SSE_DONE,
    Generation,
    ServingContext,
    SSEResponse,
    TokenText,
    event_error,
    make_params,
    openai_logprob,
    sse,
    usage,
)
from kestrel.server.tool_calls import ToolCallDelta, ToolCallParser, merge_tool_calls

DEFAULT_REASONING_EFFORT = "max"
MEDIA_KINDS = {"image_url": "image", "input_audio": "audio", "file": "file"}
# The template's only variable a client may set; the Kimi format has no on/off switch for thinking.
TEMPLATE_KWARGS = ("reasoning_effort",)
TOOL_MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_ARGS, CALL_END)
BANNED_BIAS = -100.0  # OpenAI's floor: the token is never sampled


def template_reasoning_effort(req: ChatCompletionRequest) -> str:
    """`reasoning_effort` from the body or from `chat_template_kwargs`; any other template kwarg is a 400."""
    kwargs = req.chat_template_kwargs or {}
    for key in kwargs:
        if key not in TEMPLATE_KWARGS:
            param = f"chat_template_kwargs.{key}"
            raise APIError(
                400, f"{param}: not a variable of this model's chat template (it knows {TEMPLATE_KWARGS})", param=param
            )
    effort = kwargs.get("reasoning_effort")
    if effort is None:
        return req.reasoning_effort or DEFAULT_REASONING_EFFORT
    param = "chat_template_kwargs.reasoning_effort"
    if effort not in REASONING_EFFORTS:
        raise APIError(400, f"{param}: must be one of {REASONING_EFFORTS}, got {effort!r}", param=param)
    if req.reasoning_effort is not None and req.reasoning_effort != effort:
        raise APIError(400, f"{param}: {effort!r} contradicts reasoning_effort {req.reasoning_effort!r}", param=param)
    return effort


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: ChatDelta) -> ChatDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ChatOutputParser:
    """One choice's text → reasoning, then (outside reasoning) content and tool calls. Either stage may be off."""

    def __init__(self, reasoning: bool, tools: bool, think_open: bool = False) -> None:
        self._reasoning = ReasoningParser(think_open) if reasoning else None
        self._tools = ToolCallParser() if tools else None

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools else 0

    def feed(self, text: str) -> ChatDelta:
        return self._split(*(self._reasoning.feed(text) if self._reasoning else ("", text)), final=False)

    def finish(self) -> ChatDelta:
        return self._split(*(self._reasoning.finish() if self._reasoning else ("", "")), final=True)

    def _split(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(reasoning, content)
        text, calls = self._tools.feed(content)
        if final:
            more_text, more_calls = self._tools.finish()
            text, calls = text + more_text, calls + more_calls
        return ChatDelta(reasoning, text, calls)


def parse_chat_output(text: str, reasoning: bool, tools: bool, think_open: bool = False) -> ChatDelta:
    parser = ChatOutputParser(reasoning, tools, think_open)
    out = parser.feed(text)
    out += parser.finish()
    return out


@dataclass
class ChatPlan:
    """What the template and the parsers need to know about one chat request."""

    prompt: str
    parse_reasoning: bool
    parse_tools: bool
    think_open: bool
    # False for tool_choice "none" or no tools: the tool-call markers are banned so none leak into `content`.
    tools_allowed: bool = True
    # tool_choice "required" or a named function: the output is constrained to calls to these tools.
    forced_tools: list[dict[str, Any]] | None = None
    # (param, url) of every image part, in prompt order.
    images: list[tuple[str, str]] = field(default_factory=list)


def plan_chat(req: ChatCompletionRequest, ctx: ServingContext) -> ChatPlan:
    """Validate content parts and tools / tool_choice, and render the prompt."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if (name := tool["function"]["name"]) in names:
            param = f"tools[{i}].function.name"
            raise APIError(400, f"{param}: duplicate function name {name!r}", param=param)
        names.add(name)
    choice = req.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise APIError(400, "tool_choice: needs a non-empty `tools` list", param="tool_choice")
    if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
        raise APIError(
            400, f"tool_choice: no tool named {choice.function.name!r} in `tools`", param="tool_choice.function.name"
        )
    images = []
    for i, message in enumerate(req.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            param = f"messages[{i}].content[{j}]"
            if isinstance(part, MediaPart) or (isinstance(part, ImagePart) and ctx.media is None):
                kind = MEDIA_KINDS[part.type]
                raise APIError(400, f"{param}: {kind} input is not supported by this model", param=param)
            if isinstance(part, ImagePart):
                images.append((param, part.image_url.url))
    if len(images) > ctx.max_images:
        msg = f"messages: {len(images)} images, at most {ctx.max_images} per request (--limit-mm-per-prompt)"
        raise APIError(400, msg, param="messages")
    use_tools = bool(tools) and choice != "none"
    forced = None
    if use_tools and choice == "required":
        forced = tools
    elif use_tools and choice is not None and not isinstance(choice, str):
        forced = [t for t in tools if t["function"]["name"] == choice.function.name]
    if forced is not None and req.response_format is not None and req.response_format.type != "text":
        msg = "response_format: cannot be combined with a required or named tool_choice"
        raise APIError(400, msg, param="response_format")
    try:
        prompt = render_chat(
            [m.to_template() for m in req.messages],
            tools=tools if use_tools else None,
            add_generation_prompt=True,
            reasoning_effort=template_reasoning_effort(req),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise APIError(400, f"messages: {exc}", param="messages") from None
    return ChatPlan(
        prompt=prompt,
        parse_reasoning=ctx.reasoning_parser is not None,
        parse_tools=use_tools and ctx.tool_call_parser is not None,
        think_open=prompt.endswith(THINK_BEGIN),
        tools_allowed=use_tools,
        forced_tools=forced,
        images=images,
    )


def tool_marker_bans(ctx: ServingContext) -> dict[int, float]:
    """A logit_bias that bans the tool-call marker tokens (those the tokenizer has as single tokens)."""
    tok = ctx.engine.tokenizer
    ids = [tok.token_to_id(m) for m in TOOL_MARKERS] if tok is not None else []
    return {t: BANNED_BIAS for t in ids if t is not None}


def finish_reason(engine_reason: str | None, num_calls: int) -> str | None:
    return "tool_calls" if engine_reason == "stop" and num_calls else engine_reason


def chat_logprobs(
    token_ids: list[int], logprobs: list[float] | None, top: list | None, text_of: TokenText
) -> dict[str, Any] | None:
    if logprobs is None:
        return None

    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = text_of(tid)
        return {"token": s, "logprob": openai_logprob(lp), "bytes": text_of.bytes(tid)}

    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs)):
        alts = (top[i] if top else None) or []
        content.append({**entry(tid, lp), "top_logprobs": [entry(t, v) for t, v in alts]})
    return {"content": content}


async def create_chat_completion(req: ChatCompletionRequest, client: HTTPRequest, ctx: ServingContext):
    lora = ctx.check_model(req.model)
    plan = plan_chat(req, ctx)
    ids = await ctx.encode(plan.prompt, "messages")
    images = await ctx.load_images(plan.images, ids) if plan.images else None
    if images:
        ids = expand_placeholders(ids, images, ctx.media.vision.image_token_id)
    ctx.check_prompt_len(len(ids), "messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    renames = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    params = make_params(
        lambda: req.sampling_params(
            max_tokens, ctx.max_new_tokens(len(ids)), (req.top_logprobs or 0) if req.logprobs else None
        ),
        renames,
    )
    ctx.check_context(len(ids), params.max_tokens, renames.get("max_tokens", "max_tokens"))
    ctx.check_token_ids(list(params.logit_bias), "logit_bias")
    if not plan.tools_allowed:
        params.logit_bias |= tool_marker_bans(ctx)
    if plan.forced_tools is not None:
        # A named function gets exactly one call; "required" one or more unless parallel_tool_calls is false.
        parallel = req.tool_choice == "required" and req.parallel_tool_calls is not False
        params.grammar = await ctx.compile_tool_grammar(plan.forced_tools, parallel)
    else:
        params.grammar = await ctx.compile_grammar(req.response_format)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    gen = Generation(
        ctx,
        [rid],
        [ids],
        params,
        deltas=req.stream,
        loras=[lora],
        bootstraps=ctx.bootstrap_targets(req, 1),
        images=[images],
    )
    try:
        if not req.stream:
            (output,) = await gen.outputs(client)
            return JSONResponse(_response(rid, req, plan, output, ctx))
        first = await gen.next(client)
        err = event_error(first)
        if err is not None:
            raise err
    except BaseException:
        gen.close()
        raise
    stream = ChatStream(rid, req, plan, ctx, len(ids))
    return SSEResponse(stream.run(gen, first), gen)


def _response(
    rid: str, req: ChatCompletionRequest, plan: ChatPlan, output: RequestOutput, ctx: ServingContext
) -> dict[str, Any]:
    text_of = TokenText(ctx.engine.tokenizer)
    choices = []
    for comp in output.outputs:
        parsed = parse_chat_output(comp.text, plan.parse_reasoning, plan.parse_tools, plan.think_open)
        calls = merge_tool_calls(parsed.tool_calls)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or (None if calls else "")}
        if plan.parse_reasoning:
            message["reasoning_content"] = parsed.reasoning or None
        if calls:
            message["tool_calls"] = calls
        choices.append(
            {
                "index": comp.index,
                "message": message,
                "logprobs": chat_logprobs(comp.token_ids, comp.logprobs, comp.top_logprobs, text_of),
                "finish_reason": finish_reason(comp.finish_reason, len(calls)),
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": ctx.response_model(req.model),
        "choices": choices,
        "usage": usage(len(output.prompt_token_ids), [output]),
    }


class ChatStream:
    """Engine events → `chat.completion.chunk` SSE lines, one parser per choice."""

    def __init__(self, rid: str, req: ChatCompletionRequest, plan: ChatPlan, ctx: ServingContext, n_prompt: int):
        self.rid, self.req, self.ctx, self.n_prompt = rid, req, ctx, n_prompt
        self.created, self.model = int(time.time()), ctx.response_model(req.model)
        self.parsers = [ChatOutputParser(plan.parse_reasoning, plan.parse_tools, plan.think_open) for _ in range(req.n)]
        self.text_of = TokenText(ctx.engine.tokenizer)

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        return sse(body | extra)

    async def run(self, gen: Generation, first):
        yield self.chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.req.n)
            ]
        )
        event = first
        while True:
            err = event_error(event)
            if err is not None:
                yield sse(error_body(err.message, err.type, err.param, err.code))
                break
            for d in event.deltas:
                for line in self._delta_chunks(d):
                    yield line
            if event.output is not None:
                if self.req.include_usage:
                    yield self.chunk([], usage=usage(self.n_prompt, [event.output]))
                break
            event = await gen.next()
        yield SSE_DONE

    def _delta_chunks(self, d: SeqDelta) -> list[str]:
        parser = self.parsers[d.index]
        parsed = parser.feed(d.text)
        if d.finish_reason is not None:
            parsed += parser.finish()
        lines = []
        delta: dict[str, Any] = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        logprobs = chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs, self.text_of) if d.token_ids else None
        if delta or logprobs:
            lines.append(self.chunk([{"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]))
        if d.finish_reason is not None:
            reason = finish_reason(d.finish_reason, parser.num_calls)
            lines.append(self.chunk([{"index": d.index, "delta": {}, "logprobs": None, "finish_reason": reason}]))
        return lines
