"""OpenAI-shaped error responses for everything the router refuses or cannot do."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from loraplex.spec.errors import InvalidRequestError, LoraplexError, OverloadedError


class UpstreamError(OverloadedError):
    """Every server the router tried failed before sending the first byte."""

    status = 502
    type = "upstream_error"


class RequestTooLargeError(InvalidRequestError):
    """A request body over --max-request-bytes."""

    status = 413

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the request body is larger than this server's limit of {max_bytes} bytes "
                         "(--max-request-bytes)", code="request_too_large")


def error_response(exc: LoraplexError) -> JSONResponse:
    return JSONResponse(exc.to_openai(), status_code=exc.status)


class ErrorDetail(BaseModel):
    message: str
    type: str  # e.g. invalid_request_error, not_found_error, service_unavailable, upstream_error
    param: str | None = None  # the request field at fault, when there is one
    code: str | int | None = None  # e.g. model_not_found, no_healthy_server; else the HTTP status


class ErrorResponse(BaseModel):
    """OpenAI's error shape, which every error of the router has (documented in the OpenAPI schema)."""

    error: ErrorDetail
