"""Stop conditions: which of a step's new tokens a request keeps, and why it finishes.

In: a request and the tokens its step sampled (0..n). Out: the tokens kept (appended to the
request) and its finish status, or None. Tokens are taken one by one: from min_tokens on, EOS
(unless ignore_eos) or a stop id ends the request at that token; max_tokens and the length cap
end it where they are reached. The tokens after the one that ended it are dropped.
"""

from __future__ import annotations

from tokenforge.core.request import Request, RequestStatus


def append_until_stop(req: Request, tokens: list[int], max_len: int) -> tuple[list[int], RequestStatus | None]:
    for i, token in enumerate(tokens):
        req.append_output_token(token)
        status = check_stop(req, token, max_len)
        if status is not None:
            return (tokens if i + 1 == len(tokens) else tokens[:i + 1]), status
    return tokens, None


def check_stop(req: Request, token: int, max_len: int) -> RequestStatus | None:
    """The status `token` (just appended) leaves the request in; records a stop id."""
    params = req.params
    num_out = len(req.output_token_ids)
    if num_out >= params.min_tokens:
        if not params.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            req.stop_token_id = token
            return RequestStatus.FINISHED_STOPPED
    if num_out >= params.max_tokens or req.num_tokens >= max_len:
        return RequestStatus.FINISHED_LENGTH
    return None
