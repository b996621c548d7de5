"""radixkv's OpenAI-compatible HTTP server: ``create_app(engine)`` and ``radixkv serve``."""

from server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
