"""LlamaIndex's ``OpenAIResponses.structured_predict`` runs unchanged against a real server:
it sends ``text.format`` with a JSON schema and ``tool_choice: "none"`` without ``tools``
(which OpenAI accepts, and this server refused before issue 60 #8). LlamaIndex's OpenAI
package needs ``openai<3``, so it lives in its own environment (``make setup`` builds
``.venv-llamaindex``) and runs as a client process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-llamaindex" / "bin" / "python"
CLIENT = Path(__file__).parent / "clients" / "llamaindex_structured.py"


def test_llamaindex_structured_predict_gets_its_object(server: ServerProcess) -> None:
    if not PYTHON.exists():
        pytest.skip("no .venv-llamaindex (make setup builds it)")
    run = subprocess.run(
        [str(PYTHON), str(CLIENT), server.url + "/v1", "SmolLM2-135M-Instruct"],
        capture_output=True, text=True, timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    capital = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(capital) == {"city", "country"}
    assert capital == {"city": "Paris", "country": "France"}  # greedy, under the schema
