"""OpenAI-shaped error responses for everything the router refuses or cannot do."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from loraplex.spec.errors import LoraplexError, OverloadedError


class UpstreamError(OverloadedError):
    """Every server the router tried failed before sending the first byte."""

    status = 502
    type = "upstream_error"


def error_response(exc: LoraplexError) -> JSONResponse:
    return JSONResponse(exc.to_openai(), status_code=exc.status)
