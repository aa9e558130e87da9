"""The OpenAI-compatible HTTP server behind `pagellm serve`."""
