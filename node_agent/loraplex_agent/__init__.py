"""The node agent: torch executor, model, adapter store, and the OpenAI-compatible server."""
