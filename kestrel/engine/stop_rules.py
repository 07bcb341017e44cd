"""When a sequence ends: stop strings (through its detokenizer), a finished grammar, stop / eos tokens past
`min_tokens`, and `max_tokens`. One function, so the plain and the speculative paths stop alike."""

from __future__ import annotations

from kestrel.engine.request import Request


def stop_reason(req: Request, token: int, eos_token_ids: set[int]) -> str | None:
    """Apply the stop rules to `token`, just appended to `req.output_ids` (its text is detokenized here):
    "stop", "length", or None to go on."""
    params = req.params
    if req.detokenizer is not None:
        req.output_text += req.detokenizer.push(token)
        if req.detokenizer.stopped:
            return "stop"
    # The grammar ends the request once it is complete (it accepted eos); it rejects a token only when the
    # other rules (min_tokens, logit_bias) left its row nothing it allows, and then it cannot go on.
    if req.matcher is not None and (not req.matcher.accept_token(token) or req.matcher.is_terminated()):
        return "stop"
    if len(req.output_ids) >= params.min_tokens:
        if token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos):
            return "stop"
    if len(req.output_ids) >= params.max_tokens:
        return "length"
    return None
