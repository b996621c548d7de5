"""Errors the engine raises besides ValueError for bad input."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it crashed, or the engine was closed); nothing more runs.

    When the loop crashed, ``__cause__`` is the exception that killed it.
    """
