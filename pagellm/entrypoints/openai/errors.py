"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, as vLLM sends them.

Every client mistake becomes a 4xx here; only a bug in the server is a 500,
and it is logged with its traceback while the server keeps serving.
"""

from __future__ import annotations

import uuid
from http import HTTPStatus
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.engine.async_llm import EngineDeadError, RequestFailedError
from pagellm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagellm.logger import init_logger

logger = init_logger(__name__)

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.TOO_MANY_REQUESTS: "RateLimitError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}
ENGINE_DEAD_MESSAGE = "The engine process has died; restart the server."


class OpenAIError(Exception):
    """An error with the HTTP status and message the client should see."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> ErrorResponse:
    err_type = _ERROR_TYPES.get(status, status.phrase.replace(" ", "") + "Error")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param,
                                         code=int(status)))


def error_response(message: str, status: HTTPStatus, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param).model_dump(), status_code=int(status),
                        headers=headers)


_DOCUMENTED = {
    HTTPStatus.BAD_REQUEST: "A mistake in the request: invalid JSON, a field of the wrong type "
                            "or value, text that is not valid Unicode, a prompt too long for "
                            "the model's context.",
    HTTPStatus.UNAUTHORIZED: "Missing or wrong API key (when the server has one).",
    HTTPStatus.NOT_FOUND: "A model this server does not serve, or a stored response it does "
                          "not keep.",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "The body is larger than --max-request-body-bytes.",
    HTTPStatus.TOO_MANY_REQUESTS: "More requests in flight than --max-concurrent-requests.",
    HTTPStatus.INTERNAL_SERVER_ERROR: "A fault of the server (logged with its request id).",
    HTTPStatus.SERVICE_UNAVAILABLE: "The server is shutting down or its engine has died.",
}


def documented_errors(method: str, path: str) -> dict[int | str, dict[str, Any]]:
    """The error answers a route can give, for its OpenAPI entry (a path that names a
    resource, like `/v1/responses/{response_id}`, can answer 404)."""
    statuses = list(_DOCUMENTED) if method == "POST" else [
        HTTPStatus.UNAUTHORIZED, HTTPStatus.INTERNAL_SERVER_ERROR, HTTPStatus.SERVICE_UNAVAILABLE]
    if "{" in path and HTTPStatus.NOT_FOUND not in statuses:
        statuses.append(HTTPStatus.NOT_FOUND)
    return {int(status): {"model": ErrorResponse, "description": _DOCUMENTED[status]}
            for status in statuses}


def to_openai_error(error: Exception) -> OpenAIError:
    """Map an exception raised while serving a request to what the client is told."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, EngineDeadError):
        return OpenAIError(ENGINE_DEAD_MESSAGE, HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(error, (ValueError, jinja2.TemplateError)):
        return OpenAIError(str(error))
    if isinstance(error, RequestFailedError):  # logged where it happened
        return OpenAIError(f"Internal server error: {error}", HTTPStatus.INTERNAL_SERVER_ERROR)
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    logger.error("Unexpected error while serving a request (%s)", error_id, exc_info=error)
    return OpenAIError(f"Internal server error ({type(error).__name__}); the server log has "
                       f"the details under {error_id}.", HTTPStatus.INTERNAL_SERVER_ERROR)


def stream_error_event(error: Exception) -> str:
    """The SSE event that reports an error once a stream has started."""
    converted = to_openai_error(error)
    body = error_body(converted.message, converted.status, converted.param)
    return f"data: {body.model_dump_json()}\n\n"


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """A readable summary of pydantic's errors, and the top-level field at fault."""
    problems = error.errors()
    if any(problem.get("type") == "json_invalid" for problem in problems):
        return "Request body is not valid JSON.", None
    # Our own validators' messages beat the "not a string" of every other union branch.
    problems = [p for p in problems if p.get("type") == "value_error"] or problems
    parts = []
    for problem in problems:
        location = ".".join(str(part) for part in problem.get("loc", ())
                            if part != "body" and "[" not in str(part))
        message = str(problem.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{location or 'body'}: {message}")
    first = problems[0].get("loc", ()) if problems else ()
    param = next((str(part) for part in first  # past a union's branch tag (`x[...]`)
                  if part != "body" and "[" not in str(part)), None)
    return "; ".join(parts) or "Invalid request body.", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(message, HTTPStatus.BAD_REQUEST, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        # Keeps Starlette's headers, such as a 405's `Allow`.
        return error_response(str(error.detail), HTTPStatus(error.status_code),
                              headers=dict(error.headers or {}))

    async def known_error(_: Request, error: Exception) -> JSONResponse:
        converted = to_openai_error(error)
        return error_response(converted.message, converted.status, converted.param)

    # Exception (a bug) also passes through here, but Starlette logs it with its traceback.
    for error_class in (OpenAIError, EngineDeadError, ValueError, jinja2.TemplateError, Exception):
        app.add_exception_handler(error_class, known_error)
