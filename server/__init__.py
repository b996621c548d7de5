"""radixkv's OpenAI-compatible HTTP server: ``create_app(engine, ServerConfig(...))`` and
``radixkv serve``.

``ServerConfig`` loads alone (no Starlette, no engine): a replica set's config can hold one
without the server being imported; ``create_app`` loads the app on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from server.config import ServerConfig

if TYPE_CHECKING:
    from server.app import create_app

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from server.app import create_app

        return create_app
    raise AttributeError(f"module 'server' has no attribute {name!r}")
