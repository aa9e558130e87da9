"""LoRA adapters over HTTP, as vLLM serves them: `--lora-modules` loaded at start-up, one
`/v1/models` entry per adapter (`parent`: the base model), and `POST /v1/load_lora_adapter`
/ `/v1/unload_lora_adapter`, which exist only when runtime updating is allowed
(`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` or `--enable-runtime-lora-updating`) and read only
adapters under `--lora-allowed-dirs`, so that a client cannot make the server read any path.
"""

from __future__ import annotations

import itertools
from http import HTTPStatus
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.errors import OpenAIError, documented_errors
from pagellm.entrypoints.openai.lora_args import LoRAServerSettings
from pagellm.entrypoints.openai.protocol import ModelCard, OpenAIRequestModel
from pagellm.logger import init_logger
from pagellm.lora.request import LoRARequest

logger = init_logger(__name__)


class LoadLoRAAdapterRequest(OpenAIRequestModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIRequestModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAAdapters:
    """The front end's adapters: names, integer ids and parents."""

    def __init__(self, engine: AsyncLLM, settings: LoRAServerSettings,
                 model_names: list[str]) -> None:
        self.engine, self.settings, self.model_names = engine, settings, model_names
        self._ids = itertools.count(1)
        self.parents: dict[str, str] = {}

    async def load_modules(self) -> None:
        """The --lora-modules, before the server accepts requests (a bad one stops it)."""
        for module in self.settings.modules:
            await self._add(LoRARequest(module.name, next(self._ids), module.path,
                                        module.base_model_name))

    async def _add(self, request: LoRARequest, replace: bool = False) -> None:
        if request.lora_name in self.model_names:
            raise ValueError(f"The lora adapter name '{request.lora_name}' conflicts with a "
                             "served base model.")
        await self.engine.add_lora(request, replace)
        self.parents[request.lora_name] = request.base_model_name or self.model_names[0]
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", request.lora_name,
                    request.lora_path)

    def model_cards(self, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=name, root=request.lora_path, parent=self.parents[name],
                          max_model_len=max_model_len)
                for name, request in self.engine.lora_adapters.items()]

    def _allowed(self, path: str) -> bool:
        resolved = Path(path).expanduser().resolve()
        return any(resolved.is_relative_to(folder) for folder in self.settings.allowed_dirs)

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        if not body.lora_name or not body.lora_path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.")
        existing = self.engine.lora_adapters.get(body.lora_name)
        if existing is not None and not body.load_inplace:
            raise OpenAIError(f"The lora adapter '{body.lora_name}' has already been loaded. "
                              "If you want to load the adapter in place, set 'load_inplace' to "
                              "True.", param="lora_name")
        if not self._allowed(body.lora_path):
            raise OpenAIError(f"lora_path {body.lora_path!r} is not under a directory that "
                              "--lora-allowed-dirs allows.", param="lora_path")
        lora_id = existing.lora_int_id if existing is not None else next(self._ids)
        try:
            await self._add(LoRARequest(body.lora_name, lora_id, body.lora_path),
                            replace=existing is not None)
        except ValueError as error:
            status = HTTPStatus.NOT_FOUND if "No adapter found" in str(error) else None
            raise OpenAIError(str(error), status or HTTPStatus.BAD_REQUEST) from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        if body.lora_name not in self.engine.lora_adapters:
            raise OpenAIError(f"The lora adapter '{body.lora_name}' cannot be found.",
                              HTTPStatus.NOT_FOUND, "lora_name")
        await self.engine.remove_lora(body.lora_name)
        self.parents.pop(body.lora_name, None)
        logger.info("Removed LoRA adapter: name '%s'", body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def add_lora_routes(app: FastAPI, adapters: LoRAAdapters) -> None:
    """vLLM's runtime routes; without runtime updating they do not exist (404)."""

    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Load a PEFT LoRA adapter from a folder under --lora-allowed-dirs."""
        return PlainTextResponse(await adapters.load(body))

    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """Stop serving a LoRA adapter (requests already using it finish with it)."""
        return PlainTextResponse(await adapters.unload(body))

    for path, endpoint in (("/v1/load_lora_adapter", load_lora_adapter),
                           ("/v1/unload_lora_adapter", unload_lora_adapter)):
        app.add_api_route(path, endpoint, methods=["POST"],
                          responses=documented_errors("POST", path))
