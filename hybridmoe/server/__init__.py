"""The OpenAI-compatible HTTP server: validation, chat templates, streaming; it wraps the engine."""
