"""The embedded CPU engine: an SGLang-compatible HTTP server (server.py) over a batched decoder (core.py)."""
