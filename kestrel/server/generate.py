"""`POST /generate` (SGLang's token-level API, for RL rollouts) and `POST /abort_request`.

Per generated token the response can carry its logprob; the final result can carry, as SGLang encodes them (base64
of int32 bytes), what every token that went through the model was routed to: `meta_info.routed_experts` is
[prompt + completion - 1, MoE layers, top_k] expert ids and `meta_info.indexer_topk` [same rows, DSA layers,
index_topk] attended positions (ascending, -1 padded). Row i belongs to the forward row whose input was token i,
prompt rows included (cached prefix tokens report their first computation), so a trainer can replay the sequence.
`meta_info.weight_version` (and `lora_version` / `lora_checksum` with an adapter) name what every token of the
result came from; a sequence retracted by a weight sync starts over, and its next stream chunk says so by
being the whole new result (chunks are cumulative).
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request as HTTPRequest

from kestrel.engine.outputs import CompletionOutput
from kestrel.server.engine_events import SeqDelta, StreamEvent
from kestrel.server.errors import APIError, error_body
from kestrel.server.protocol import AbortRequest, GenerateRequest
from kestrel.server.serving import (
    SSE_DONE,
    Generation,
    ServingContext,
    SSEResponse,
    event_error,
    json_float,
    make_params,
    sse,
)

_RENAMES = {
    "max_tokens": "sampling_params.max_new_tokens",
    "min_tokens": "sampling_params.min_new_tokens",
    "seed": "sampling_params.sampling_seed",
    "logprobs": "top_logprobs_num",
}
_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
_RENAMES |= {f: f"sampling_params.{f}" for f in (*_FIELDS, "repetition_penalty", "stop", "stop_token_ids")}

CAPTURE_FIELDS = ("routed_experts", "indexer_topk")  # return_X per request, enable_return_X per server


async def _prompts(req: GenerateRequest, ctx: ServingContext) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether the request was a batch (which answers with a list)."""
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "exactly one of `text` and `input_ids` is required", param="input_ids")
    if req.text is not None:
        batch, param = isinstance(req.text, list), "text"
        prompts = [await ctx.encode(t, param) for t in (req.text if batch else [req.text])]
    else:
        batch, param = bool(req.input_ids) and isinstance(req.input_ids[0], list), "input_ids"
        prompts = [list(p) for p in (req.input_ids if batch else [req.input_ids])]
        for ids in prompts:
            ctx.check_token_ids(ids, param)
    for ids in prompts:
        ctx.check_prompt_len(len(ids), param)
    return prompts, batch


def _request_ids(req: GenerateRequest, num: int, batch: bool) -> list[str]:
    if req.rid is None:
        return [uuid.uuid4().hex for _ in range(num)]
    rids = req.rid if isinstance(req.rid, list) else [req.rid]
    if isinstance(req.rid, list) != batch or len(rids) != num or len(set(rids)) != num:
        raise APIError(400, f"rid: needs one distinct rid per prompt ({num}), a list for a batch", param="rid")
    return rids


def _loras(req: GenerateRequest, ctx: ServingContext, num: int, batch: bool) -> list[str | None]:
    """SGLang's `lora_path`: an adapter name for every prompt, or (a batch) one per prompt (null: the base)."""
    if not isinstance(req.lora_path, list):
        return [ctx.check_lora(req.lora_path)] * num
    if not batch or len(req.lora_path) != num:
        raise APIError(400, f"lora_path: a list needs one entry per prompt of a batch ({num})", param="lora_path")
    return [ctx.check_lora(name) for name in req.lora_path]


def _check_logprob_start(req: GenerateRequest, prompts: list[list[int]]) -> int | None:
    """`prompt_logprobs` for the engine, or None when no input-token logprobs were asked for."""
    start = req.logprob_start_len
    if start == -1:
        return None
    if not req.return_logprob:
        raise APIError(400, "logprob_start_len: requires return_logprob to be true", param="logprob_start_len")
    shortest = min(len(p) for p in prompts)
    if not 0 <= start < shortest:
        raise APIError(
            400, f"logprob_start_len: must be -1 or in [0, {shortest}), got {start}", param="logprob_start_len"
        )
    return req.top_logprobs_num


def _check_capture(req: GenerateRequest, ctx: ServingContext) -> None:
    """Capture is recorded for every token only when the server was started for it (SGLang's two-level opt-in)."""
    config = ctx.engine.engine_config
    for name in CAPTURE_FIELDS:
        if getattr(req, f"return_{name}") and not getattr(config, f"enable_return_{name}"):
            flag = f"--enable-return-{name.replace('_', '-')}"
            raise APIError(400, f"return_{name}: start the server with {flag}", param=f"return_{name}")


def _with_default_capture(req: GenerateRequest, ctx: ServingContext) -> GenerateRequest:
    """`--capture-by-default`: the request as if it had asked for every table the server records."""
    config = ctx.engine.engine_config
    if not config.capture_by_default:
        return req
    wanted = {f"return_{name}": True for name in CAPTURE_FIELDS if getattr(config, f"enable_return_{name}")}
    return req.model_copy(update=wanted)


def _finish(reason: str | None, num_tokens: int) -> dict[str, Any] | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": num_tokens}
    return {"type": reason}


@dataclass
class _Seq:
    """One sequence's output so far: the streamed deltas add up to it; the final output replaces it."""

    rid: str
    prompt: list[int]
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    final: CompletionOutput | None = None
    prompt_logprobs: list | None = None
    versions: tuple[str | None, str | None, str | None] = (None, None, None)  # weights, adapter, its checksum

    def add(self, d: SeqDelta) -> None:
        self.versions = (d.weight_version, d.lora_version, d.lora_checksum)
        self.text += d.text
        self.output_ids += d.token_ids
        self.logprobs += d.logprobs or []
        self.top_logprobs += d.top_logprobs or []
        self.finish_reason = d.finish_reason or self.finish_reason

    def finish(self, comp: CompletionOutput, prompt_logprobs: list | None) -> None:
        self.final, self.prompt_logprobs = comp, prompt_logprobs
        self.versions = (comp.weight_version, comp.lora_version, comp.lora_checksum)
        self.text, self.output_ids, self.finish_reason = comp.text, comp.token_ids, comp.finish_reason
        self.logprobs, self.top_logprobs = comp.logprobs or [], comp.top_logprobs or []

    def result(self, req: GenerateRequest) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": _finish(self.finish_reason, len(self.output_ids)),
            "prompt_tokens": len(self.prompt),
            "completion_tokens": len(self.output_ids),
            "weight_version": self.versions[0],
        }
        if self.versions[2] is not None:
            meta["lora_version"], meta["lora_checksum"] = self.versions[1], self.versions[2]
        if self.final is not None:
            meta["cached_tokens"] = self.final.cached_tokens
            meta["cached_tokens_by_tier"] = self.final.cached_tokens_by_tier
            if self.final.spec_verify_ct:
                meta["spec_verify_ct"] = self.final.spec_verify_ct
                meta["spec_accept_length"] = self.final.spec_accept_length
        if req.return_logprob:
            meta["output_token_logprobs"] = [[json_float(lp), t, None] for lp, t in zip(self.logprobs, self.output_ids)]
            tops = self.top_logprobs
            meta["output_top_logprobs"] = [[[json_float(v), t, None] for t, v in top or []] for top in tops]
        if self.prompt_logprobs is not None:
            # SGLang's layout: one entry per input position from logprob_start_len; position 0 has no logprob.
            entries = self.prompt_logprobs[req.logprob_start_len :]
            first = req.logprob_start_len
            meta["input_token_logprobs"] = [
                [None if e is None else json_float(e.logprob), self.prompt[first + i], None]
                for i, e in enumerate(entries)
            ]
            meta["input_top_logprobs"] = [
                None if e is None else [[json_float(v), t, None] for t, v in e.top] for e in entries
            ]
        if self.final is not None and req.return_routed_experts and self.final.routed_experts is not None:
            meta["routed_experts"] = _b64(self.final.routed_experts[req.routed_experts_start_len :])
        if self.final is not None and req.return_indexer_topk and self.final.indexer_topk is not None:
            meta["indexer_topk"] = _b64(self.final.indexer_topk)
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}


def _b64(rows) -> str:
    """SGLang's wire format of capture tables: base64 of the int32 array's bytes (C order)."""
    return base64.b64encode(rows.contiguous().numpy().tobytes()).decode("ascii")


async def generate(req: GenerateRequest, client: HTTPRequest, ctx: ServingContext):
    prompts, batch = await _prompts(req, ctx)
    prompt_logprobs = _check_logprob_start(req, prompts)
    _check_capture(req, ctx)
    req = _with_default_capture(req, ctx)
    logprobs = req.top_logprobs_num if req.return_logprob else None
    longest = max(len(p) for p in prompts)
    params = make_params(
        lambda: req.sampling_params.to_params(ctx.max_new_tokens(longest), logprobs, prompt_logprobs), _RENAMES
    )
    ctx.check_context(longest, params.max_tokens, _RENAMES["max_tokens"])
    rids = _request_ids(req, len(prompts), batch)
    n = params.n
    seqs = {(p, i): _Seq(rid, ids) for p, (rid, ids) in enumerate(zip(rids, prompts)) for i in range(n)}
    loras = _loras(req, ctx, len(prompts), batch)
    boots = ctx.bootstrap_targets(req, len(prompts))
    gen = Generation(
        ctx,
        rids,
        prompts,
        params,
        req.stream,
        routed_experts=req.return_routed_experts,
        loras=loras,
        restartable=True,
        bootstraps=boots,
        indexer_topk=req.return_indexer_topk,
    )
    if req.stream:
        return SSEResponse(_stream(req, gen, seqs, n, many=len(seqs) > 1), gen)
    try:
        while not gen.finished:
            event = await gen.next(client)
            err = event_error(event)
            if err is not None:
                raise err
            _apply(event, gen, seqs)
    finally:
        gen.close()
    results = [s.result(req) for s in seqs.values()]
    return JSONResponse(results if batch else results[0] if len(results) == 1 else results)


def _apply(event: StreamEvent, gen: Generation, seqs: dict[tuple[int, int], _Seq]) -> list[tuple[int, int]]:
    """Fold one event into the sequences; returns the keys of those that changed."""
    p = gen.index[event.request_id]
    changed = []
    for d in event.deltas:
        if d.reset:  # retracted and rerun: what came before was from another run (another version)
            old = seqs[p, d.index]
            seqs[p, d.index] = _Seq(old.rid, old.prompt)
        seqs[p, d.index].add(d)
        changed.append((p, d.index))
    if event.output is not None:
        for comp in event.output.outputs:
            seqs[p, comp.index].finish(comp, event.output.prompt_logprobs)
            changed.append((p, comp.index))
    return list(dict.fromkeys(changed))


async def _stream(req: GenerateRequest, gen: Generation, seqs: dict[tuple[int, int], _Seq], n: int, many: bool):
    """SGLang's stream: each chunk is one sequence's result so far (cumulative text), then `[DONE]`."""
    while not gen.finished:
        event = await gen.next()
        err = event_error(event)
        if err is not None:
            yield sse(error_body(err.message, err.type, err.param, err.code))
            break
        for p, i in _apply(event, gen, seqs):
            out = seqs[p, i].result(req)
            yield sse(out | {"index": p * n + i} if many else out)
    yield SSE_DONE


async def abort_request(req: AbortRequest, ctx: ServingContext) -> JSONResponse:
    return JSONResponse({"rid": req.rid, "aborted": ctx.engine.abort(req.rid)})
