"""Where radixkv keeps what it computes once and reuses: converted checkpoints, built kernels,
measured verdicts, tokenizers, the server's stored responses."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/radixkv`` (default ``~/.cache/radixkv``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixkv"
