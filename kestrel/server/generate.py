"""`POST /generate` (SGLang's token-level API, for RL rollouts) and `POST /abort_request`.

Per generated token the response can carry its logprob and the experts every MoE layer routed to. Routed
experts follow the replay convention: entry k is what each MoE layer chose when the token at position
`prompt_tokens - 1 + k` was the input — the forward row whose logits sampled output token k. A trainer replays
them for the rows that score the completion (`routed_experts_start_position` says where they start).
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request as HTTPRequest

from kestrel.engine.engine import CompletionOutput
from kestrel.server.errors import APIError
from kestrel.server.protocol import AbortRequest, GenerateRequest
from kestrel.server.serving import Generation, ServingContext, event_error, make_params

_RENAMES = {
    "max_tokens": "sampling_params.max_new_tokens",
    "min_tokens": "sampling_params.min_new_tokens",
    "seed": "sampling_params.sampling_seed",
    "logprobs": "top_logprobs_num",
}
_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
_RENAMES |= {f: f"sampling_params.{f}" for f in (*_FIELDS, "repetition_penalty", "stop", "stop_token_ids")}


async def _prompt(req: GenerateRequest, ctx: ServingContext) -> list[int]:
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "exactly one of `text` and `input_ids` is required", param="input_ids")
    if req.text is not None:
        ids = await ctx.encode(req.text, "text")
        param = "text"
    else:
        ids, param = list(req.input_ids), "input_ids"
        ctx.check_token_ids(ids, param)
    ctx.check_prompt_len(len(ids), param)
    return ids


def _finish(comp: CompletionOutput) -> dict[str, Any] | None:
    if comp.finish_reason is None:
        return None
    if comp.finish_reason == "length":
        return {"type": "length", "length": len(comp.token_ids)}
    return {"type": comp.finish_reason}


async def generate(req: GenerateRequest, client: HTTPRequest, ctx: ServingContext) -> JSONResponse:
    if req.stream:
        raise APIError(400, "stream: not supported by /generate", param="stream")
    ids = await _prompt(req, ctx)
    logprobs = req.top_logprobs_num if req.return_logprob else None
    params = make_params(lambda: req.sampling_params.to_params(ctx.max_new_tokens(len(ids)), logprobs), _RENAMES)
    ctx.check_context(len(ids), params.max_tokens, _RENAMES["max_tokens"])
    rid = req.rid or uuid.uuid4().hex
    # Deltas carry the routed experts (the final output does not), so collect them as they come.
    want = req.return_routed_experts
    gen = Generation(ctx, [rid], [ids], params, deltas=want, routed_experts=want)
    routed: dict[int, list[dict[int, list[int]]]] = {}
    try:
        while not gen.finished:
            event = await gen.next(client)
            err = event_error(event)
            if err is not None:
                raise err
            for d in event.deltas:
                routed.setdefault(d.index, []).extend(d.routed_experts or [])
            output = event.output
    finally:
        gen.close()
    results = []
    for comp in output.outputs:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": _finish(comp),
            "prompt_tokens": len(ids),
            "completion_tokens": len(comp.token_ids),
            "cached_tokens": comp.cached_tokens,
            "cached_tokens_by_tier": comp.cached_tokens_by_tier,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(comp.logprobs, comp.token_ids)]
            meta["output_top_logprobs"] = [[[v, t, None] for t, v in top or []] for top in comp.top_logprobs]
        if req.return_routed_experts:
            entries = routed.get(comp.index, [])
            layers = sorted(entries[0]) if entries else []
            meta["routed_experts_layers"] = layers
            meta["routed_experts_start_position"] = len(ids) - 1
            meta["routed_experts"] = [[e[layer] for layer in layers] for e in entries]
        results.append({"text": comp.text, "output_ids": comp.token_ids, "meta_info": meta})
    return JSONResponse(results[0] if len(results) == 1 else results)


async def abort_request(req: AbortRequest, ctx: ServingContext) -> JSONResponse:
    return JSONResponse({"rid": req.rid, "aborted": ctx.engine.abort(req.rid)})
