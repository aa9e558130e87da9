"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes."""

from __future__ import annotations

from pagellm.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse,
                                                 TokenizeChatRequest, TokenizeCompletionRequest,
                                                 TokenizeResponse)
from pagellm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest
                       ) -> TokenizeResponse:
        """A prompt is encoded as /v1/completions would; messages as /v1/chat/completions.

        Both off the event loop when large."""
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            tokens = (await self.render_chat(request.messages, request.add_generation_prompt,
                                             request.chat_template_kwargs)).token_ids
        else:
            tokens = await self.engine.encode(request.prompt, request.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len,
                                tokens=tokens)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        token_ids = self.engine.input_processor.process_prompt(request.tokens).token_ids
        return DetokenizeResponse(prompt=await self.engine.decode(token_ids))
