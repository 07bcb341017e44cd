"""`POST /v1/completions`: raw prompts (text or token ids, one or a batch) in, text out; no template, no parsers."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request as HTTPRequest

from kestrel.server.engine_events import SeqDelta
from kestrel.server.errors import APIError, error_body
from kestrel.server.protocol import CompletionRequest
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


async def _prompts(req: CompletionRequest, ctx: ServingContext) -> list[list[int]]:
    raw = req.prompt
    batch = raw if isinstance(raw, list) and not isinstance(raw[0], int) else [raw]
    prompts = []
    for p in batch:
        ids = await ctx.encode(p, "prompt") if isinstance(p, str) else list(p)
        ctx.check_token_ids(ids, "prompt")
        ctx.check_prompt_len(len(ids), "prompt")
        prompts.append(ids)
    return prompts


def completion_logprobs(
    token_ids: list[int], logprobs: list[float] | None, top: list | None, text_of: TokenText, offset: int = 0
) -> dict[str, Any] | None:
    """The legacy completions layout: parallel lists of tokens, logprobs, top alternatives and text offsets."""
    if logprobs is None:
        return None
    tokens = [text_of(t) for t in token_ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [openai_logprob(x) for x in logprobs],
        "top_logprobs": [
            {text_of(t): openai_logprob(v) for t, v in (top[i] if top else None) or []} for i in range(len(tokens))
        ],
        "text_offset": offsets,
    }


async def create_completion(req: CompletionRequest, client: HTTPRequest, ctx: ServingContext):
    lora = ctx.check_model(req.model)
    if req.echo:
        raise APIError(400, "echo: not supported", param="echo")
    if req.suffix:
        raise APIError(400, "suffix: not supported (this model has no fill-in-the-middle format)", param="suffix")
    prompts = await _prompts(req, ctx)
    longest = max(len(p) for p in prompts)
    params = make_params(lambda: req.sampling_params(req.max_tokens, ctx.max_new_tokens(longest), req.logprobs))
    ctx.check_context(longest, params.max_tokens, "max_tokens")
    ctx.check_token_ids(list(params.logit_bias), "logit_bias")
    params.grammar = await ctx.compile_grammar(req.response_format)
    base = f"cmpl-{uuid.uuid4().hex}"
    rids = [base if len(prompts) == 1 else f"{base}-{i}" for i in range(len(prompts))]
    boots = ctx.bootstrap_targets(req, len(prompts))
    gen = Generation(ctx, rids, prompts, params, deltas=req.stream, loras=[lora] * len(prompts), bootstraps=boots)
    try:
        if not req.stream:
            outputs = await gen.outputs(client)
        else:
            first = await gen.next(client)
            err = event_error(first)
            if err is not None:
                raise err
    except BaseException:
        gen.close()
        raise
    text_of = TokenText(ctx.engine.tokenizer)
    n_prompt = sum(len(p) for p in prompts)
    if req.stream:
        return SSEResponse(_stream(base, req, gen, first, ctx, text_of, n_prompt), gen)
    choices = [
        {
            "index": p * req.n + c.index,
            "text": c.text,
            "logprobs": completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs, text_of),
            "finish_reason": c.finish_reason,
        }
        for p, out in enumerate(outputs)
        for c in out.outputs
    ]
    body = {
        "id": base,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.response_model(req.model),
        "choices": choices,
        "usage": usage(n_prompt, outputs),
    }
    return JSONResponse(body)


async def _stream(base: str, req: CompletionRequest, gen: Generation, first, ctx: ServingContext, text_of, n_prompt):
    created, model = int(time.time()), ctx.response_model(req.model)
    offsets: dict[int, int] = {}
    finals = []

    def chunk(d: SeqDelta, prompt_index: int) -> dict[str, Any]:
        index = prompt_index * req.n + d.index
        lp = completion_logprobs(d.token_ids, d.logprobs, d.top_logprobs, text_of, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + sum(len(text_of(t)) for t in d.token_ids)
        choice = {"index": index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        head = {"id": base, "object": "text_completion", "created": created, "model": model}
        return head | {"choices": [choice]}

    event = first
    while True:
        err = event_error(event)
        if err is not None:
            yield sse(error_body(err.message, err.type, err.param, err.code))
            break
        for d in event.deltas:
            yield sse(chunk(d, gen.index[event.request_id]))
        if event.output is not None:
            finals.append(event.output)
        if gen.finished:
            if req.include_usage:
                body = {"id": base, "object": "text_completion", "created": created, "model": model}
                yield sse(body | {"choices": [], "usage": usage(n_prompt, finals)})
            break
        event = await gen.next()
    yield SSE_DONE
