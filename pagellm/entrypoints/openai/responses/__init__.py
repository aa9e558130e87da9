"""OpenAI's Responses API (`/v1/responses`) on the chat-completions machinery."""
