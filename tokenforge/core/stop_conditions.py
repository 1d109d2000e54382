"""Stop conditions: which of a step's new tokens a request keeps, and why it finishes.

In: a request and the tokens its step sampled (0..n). Out: the tokens kept (appended to the
request) and its finish status, or None. Tokens are taken one by one: from min_tokens on, EOS
(unless ignore_eos) or a stop id ends the request at that token (a stop id is recorded as
`stop_token_id`); max_tokens and the length cap end it where they are reached. The tokens after
the one that ended it are dropped.
"""

from __future__ import annotations

from tokenforge.core.request import Request, RequestStatus


def append_until_stop(req: Request, tokens: list[int], max_len: int) -> tuple[list[int], RequestStatus | None]:
    params = req.params
    for i, token in enumerate(tokens):    # once per request and step: the checks stay inline
        req.append_output_token(token)
        num_out = len(req.output_token_ids)
        status = None
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                req.stop_token_id = token
                status = RequestStatus.FINISHED_STOPPED
        if status is None and (num_out >= params.max_tokens or req.num_tokens >= max_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            return (tokens if i + 1 == len(tokens) else tokens[:i + 1]), status
    return tokens, None


def stop_ids(req: Request) -> tuple[int, ...]:
    """The ids that end the request where it samples them: EOS (unless ignore_eos), then its stop ids."""
    p = req.params
    return (*(() if p.ignore_eos else req.eos_token_ids), *p.stop_token_ids)


def banned_tokens(req: Request) -> tuple[int, ...]:
    """EOS (unless ignore_eos) and stop ids while this sample is before min_tokens."""
    if req.params.min_tokens <= req.num_output_tokens + req.num_output_placeholders:
        return ()
    return stop_ids(req)
