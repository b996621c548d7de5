"""A uvicorn server whose stop ends every stream properly.

uvicorn's own graceful shutdown waits for connections to close, then cancels what is left:
a client streaming at that moment sees its connection cut mid-stream (no last chunk, no
[DONE]) and the log gets a traceback per stream. Here the engine is closed when the grace
period ends, which aborts every request in flight: each stream sends its final chunk
(finish_reason "abort") and [DONE] in the ``ENDING_S`` uvicorn is given beyond the grace.
"""

from __future__ import annotations

import threading
from typing import Any

import uvicorn

ENDING_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn, where a stop lets requests in flight finish for ``grace_s`` and then aborts
    the rest through ``engine.close()``. Give it ``timeout_graceful_shutdown = grace_s +
    ENDING_S``."""

    def __init__(self, config: uvicorn.Config, engine: Any, grace_s: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace_s = grace_s
        self._deadline: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._deadline is None:
            self._deadline = threading.Timer(self._grace_s, self._engine.close)
            self._deadline.daemon = True
            self._deadline.start()
        super().handle_exit(sig, frame)
