"""Errors every layer raises: those of the API, each mapped to one HTTP status and OpenAI error type at
the edge, and `CommandError`, the one a `loraplex` command prints."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pydantic is not imported for `loraplex --help`
    from pydantic import ValidationError


class LoraplexError(Exception):
    """Base class. `status` and `type` give the OpenAI error shape; `param` names the bad field."""

    status: int = 500
    type: str = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


class InvalidRequestError(LoraplexError):
    status = 400
    type = "invalid_request_error"


class NotFoundError(LoraplexError):
    status = 404
    type = "not_found_error"


class AdapterError(LoraplexError):
    """An adapter that cannot be read, is corrupt, or does not fit the base model."""

    status = 400
    type = "invalid_request_error"


class AuthenticationError(LoraplexError):
    status = 401
    type = "authentication_error"


class PermissionDeniedError(LoraplexError):
    status = 403
    type = "permission_error"


class ConflictError(LoraplexError):
    status = 409
    type = "invalid_request_error"


class OverloadedError(LoraplexError):
    status = 503
    type = "service_unavailable"


class CommandError(Exception):
    """A user-facing failure of a `loraplex` command: printed as `error: <message>`, exit status 2.
    Library code a command runs raises it too, so it lives here, below every layer, not in the CLI."""


def one_line(exc: BaseException) -> str:
    """An exception's message on one line; a YAML parse error as its problem and position."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is not None and problem:  # yaml.MarkedYAMLError
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split()) or type(exc).__name__


def validation_line(exc: ValidationError) -> str:
    """pydantic's error block as one line: the first field's path, what is wrong, and how many more."""
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "the document"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}{more}"
