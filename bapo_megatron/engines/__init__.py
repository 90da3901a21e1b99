"""Inference servers: HTTP client, launchers (SGLang, embedded), supervisor, pool, the event-loop thread."""
