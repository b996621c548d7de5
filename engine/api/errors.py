"""Errors the engine raises besides ValueError for bad input."""

from __future__ import annotations

from engine.api.client import context_limit


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it crashed, or the engine was closed); nothing more runs.

    When the loop crashed, ``__cause__`` is the exception that killed it.
    """


class ContextLengthError(ValueError):
    """A request that cannot fit: its prompt plus ``max_new_tokens`` exceed the model's context
    (``limit`` = the context) or, alone, the KV pool (``limit`` = the pool's tokens). A
    ValueError naming ``field``; the numbers let a front end say it in its own words (the
    OpenAI server's ``context_length_exceeded``, naming ``max_tokens``)."""

    def __init__(
        self, message: str, field: str, prompt_tokens: int, max_new_tokens: int, limit: int,
        of_pool: bool,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.limit = limit
        self.of_pool = of_pool

    @property
    def context(self) -> int:
        """Prompt + generated tokens one request may hold under the limit it broke (the
        pool's: ``context_limit`` of it)."""
        return context_limit(None, self.limit) if self.of_pool else self.limit

    def __reduce__(self) -> tuple:
        """Whole across processes (a replica's error reaches the front through Ray)."""
        return (type(self), (str(self), self.field, self.prompt_tokens, self.max_new_tokens,
                             self.limit, self.of_pool))
