"""The server tests' client: the official ``openai`` client on the session's server."""

from __future__ import annotations

import openai
import pytest
from server_process import ServerProcess


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    """On the session's server (its response store is a file of its own: ServerProcess)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
