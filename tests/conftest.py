"""Session-wide fixtures: the bundled model is loaded once per test session and shared."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler.batch import BatchEntry
from tests.server_process import ServerProcess


def _one_thread() -> None:
    """One intra-op thread: on a shared 2-core machine, OpenMP's spinning threads fight other
    processes and a forward pass runs 10x slower than single-threaded (measured here)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def loaded_fp32() -> Any:
    """Our model for the bundled SmolLM2, float32 on the CPU (exactness tests)."""
    from engine.model.bringup.load import load_model

    _one_thread()
    return load_model(None, "cpu", "float32")


@pytest.fixture(scope="session")
def hf_model() -> Any:
    """transformers' own model for the bundled SmolLM2, float32 on the CPU (the reference)."""
    from engine.model.loader import load_hf_reference

    _one_thread()
    return load_hf_reference()


@pytest.fixture(scope="session")
def tokenizer(loaded_fp32: Any) -> Any:
    return loaded_fp32.tokenizer




@pytest.fixture(scope="session")
def make_entry() -> Any:
    """``make_entry(request, input_ids, start_pos, pages, page_size, sample=True)`` builds a
    BatchEntry with the slots its page table implies (for hand-built test batches)."""
    return BatchEntry.on_pages


# ------------------------------------------------------------------------- the HTTP server


@pytest.fixture(scope="session")
def server() -> Any:
    """The session's server: float32, 1024 pages of 16 tokens, no API key, no queue limit."""
    proc = ServerProcess("--num-pages", "1024")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def server_url(server: ServerProcess) -> str:
    return server.url
