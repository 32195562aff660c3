"""The frontend process: OpenAI-compatible HTTP/SSE API, tokenization and detokenization."""
