"""The HTTP API server: OpenAI-compatible routes on FastAPI."""
