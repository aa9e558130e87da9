"""The router's OpenAI-shaped errors, without the engine that `pagellm serve`'s errors import.

Same body as the server's (`{"error": {"message", "type", "param", "code"}}`); the router
only ever answers 400, 404, 405, 503 itself, and 500 for a bug of its own.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagellm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagellm.logger import init_logger

logger = init_logger(__name__)

_TYPES = {HTTPStatus.BAD_REQUEST: "BadRequestError", HTTPStatus.NOT_FOUND: "NotFoundError",
          HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
          HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
          HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError"}


def router_error(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> HTTPException:
    """What the router raises for a request it answers itself."""
    return HTTPException(int(status), detail=message)


def error_response(message: str, status: HTTPStatus) -> JSONResponse:
    info = ErrorInfo(message=message, type=_TYPES.get(status, "APIError"), code=int(status))
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=int(status))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return error_response(str(error.detail), HTTPStatus(error.status_code))

    @app.exception_handler(Exception)
    async def bug(_: Request, error: Exception) -> JSONResponse:
        logger.exception("Unexpected error in the router", exc_info=error)
        return error_response(f"Internal server error: {type(error).__name__}",
                              HTTPStatus.INTERNAL_SERVER_ERROR)
