"""Every error the server returns, in one place, with OpenAI's body and the HTTP status.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Handlers turn APIError, request-validation failures (bad JSON, wrong types) and routing errors
into that body. Anything else is a bug: it is logged with its traceback and answered 500 with
the same body shape, never a stack trace.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
    405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
    415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, message: str, *, status: int = 400, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


# ---- the common cases -------------------------------------------------------------------------------

def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, status=400, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")


def unauthorized(message: str = "Invalid or missing API key: send 'Authorization: Bearer <key>'.") -> APIError:
    return APIError(message, status=401, code="invalid_api_key")


def overloaded(retry_after: int = 1) -> APIError:
    return APIError("The server is overloaded: too many requests are queued. Retry later.", status=429,
                    code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})


def unavailable(message: str, code: str = "service_unavailable") -> APIError:
    return APIError(message, status=503, code=code)


def body_too_large(limit: int) -> APIError:
    return APIError(f"The request body is larger than the limit of {limit} bytes.", status=413,
                    code="request_too_large")


def timed_out(seconds: float) -> APIError:
    return APIError(f"The request did not finish within {seconds:g} s and was aborted.", status=408,
                    code="request_timeout")


def from_value_error(err: ValueError, default_param: str | None = None) -> APIError:
    """A ValueError from parameter or prompt validation. SamplingParams messages start with the
    field's name; anything else (prompt checks) is attributed to `default_param`."""
    message = str(err) or "invalid request"
    first = message.split(" ", 1)[0]
    param = first if first in _PARAM_NAMES else default_param
    code = "context_length_exceeded" if "max_model_len" in message else None
    return bad_request(message, param=param, code=code)


_PARAM_NAMES = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs", "prompt_logprobs",
    "logit_bias",
})


# ---- handlers ---------------------------------------------------------------------------------------

def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {first.get('msg', '')}", None
    if not loc:   # the body as a whole: missing, or not a JSON object
        return "The request body must be a JSON object (send Content-Type: application/json).", None
    where = ".".join(loc)
    message = f"{where}: {first.get('msg', 'invalid value')}" if where else first.get("msg", "invalid request")
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return message, (loc[0] if loc else None)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _describe_validation(exc)
    return bad_request(message, param=param).response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    detail = exc.detail if isinstance(exc.detail, str) else "request failed"
    return APIError(detail, status=exc.status_code).response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError("Internal server error.", status=500).response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
