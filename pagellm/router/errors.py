"""The router's OpenAI-shaped errors, without the engine that `pagellm serve`'s errors import.

Same body as the server's (`{"error": {"message", "type", "param", "code"}}`); the router
only ever answers 400, 404, 405, 503 itself, and 500 for a bug of its own.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagellm.logger import init_logger

logger = init_logger(__name__)

_TYPES = {HTTPStatus.BAD_REQUEST: "BadRequestError", HTTPStatus.NOT_FOUND: "NotFoundError",
          HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
          HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
          HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError"}


class RouterError(Exception):
    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_response(message: str, status: HTTPStatus, param: str | None = None) -> JSONResponse:
    info = ErrorInfo(message=message, type=_TYPES.get(status, "APIError"), param=param,
                     code=int(status))
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=int(status))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RouterError)
    async def router_error(_: Request, error: RouterError) -> JSONResponse:
        return error_response(error.message, error.status, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(str(error.detail), HTTPStatus(error.status_code))

    @app.exception_handler(Exception)
    async def bug(_: Request, error: Exception) -> JSONResponse:
        logger.exception("Unexpected error in the router", exc_info=error)
        return error_response(f"Internal server error: {type(error).__name__}",
                              HTTPStatus.INTERNAL_SERVER_ERROR)
