"""The web page at `/` (chat playground and engine view) and the JSON it polls, `/engine/stats`.

The page is plain HTML, CSS and JavaScript committed under `static/`: nothing is built at
install time. Its files carry no data, so they are served without the API key (a browser
cannot put a bearer token on a page load); everything the page shows comes from routes
that need the key when the server has one: `/v1/models`, `/v1/chat/completions` and
`/engine/stats`. The page asks for the key when one of them answers 401.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from pagellm.engine.async_llm import AsyncLLM
from pagellm.metrics.engine_view import EngineViewRecorder

STATIC_DIR = Path(__file__).resolve().parent / "static"
_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}
_ASSETS = {"/": "index.html", **{f"/static/{file.name}": file.name
                                 for file in sorted(STATIC_DIR.iterdir())
                                 if file.suffix in (".js", ".css")}}
PUBLIC_PATHS = frozenset(_ASSETS)


def add_engine_stats(app: FastAPI, engine: AsyncLLM) -> EngineViewRecorder:
    """`GET /engine/stats`, fed by a recorder that sees every step's statistics records."""
    recorder = EngineViewRecorder(engine.info.num_kv_blocks)
    engine.stat_loggers.append(recorder)

    async def engine_stats(raw_request: Request) -> JSONResponse:
        """The engine now: running and waiting requests, KV cache usage and a map of its
        blocks (free, used, cached for prefixes; offloaded in the second tier), prefix-cache
        hit rate, preemptions, and prompt and generation throughput over the last minutes."""
        snapshot: dict[str, Any] = recorder.snapshot()
        snapshot["model"] = engine.model_name
        snapshot["max_model_len"] = engine.info.max_model_len
        return JSONResponse(snapshot)

    app.add_api_route("/engine/stats", engine_stats, methods=["GET"])
    return recorder


def _asset(file: Path) -> Callable[[], Awaitable[FileResponse]]:
    async def asset() -> FileResponse:
        return FileResponse(file, media_type=_MEDIA_TYPES[file.suffix],
                            headers={"Cache-Control": "no-cache"})

    return asset


def add_playground(app: FastAPI) -> None:
    """The page and its assets, read from disk at each request (they are a few kB)."""
    for path, name in _ASSETS.items():
        app.add_api_route(path, _asset(STATIC_DIR / name), methods=["GET"],
                          include_in_schema=False)


def ready_line(host: str, port: int, frontend: bool) -> str:
    """The last start-up line: the URLs a person and a program need."""
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    base = f"http://{shown}:{port}"
    sdk = f'point an OpenAI SDK at base_url="{base}/v1"'
    if not frontend:
        return f"pagellm is ready: {sdk}"
    return f"pagellm is ready: open {base}/ in a browser (chat and engine view), {sdk}"
