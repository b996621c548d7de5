"""The conversation bench against the session's server: every turn completes, later turns
continue their stored conversation (and, with nothing evicting it, find it cached), and the
record and table are written."""

from __future__ import annotations

import json
from pathlib import Path

from workloads.http_bench import conversations


def test_the_conversation_bench_measures_later_turns_hitting_their_conversation(
    server_url: str, tmp_path: Path
) -> None:
    argv = [
        "--url", server_url, "--conversations", "2", "--turns", "3", "--think-time", "0.05",
        "--doc-words", "64", "--max-output-tokens", "4", "--filler-streams", "0",
        "--out", str(tmp_path),
    ]
    [result] = conversations.main(argv)
    assert result.failed == 0
    assert result.later_turn_hit > 0.5, result
    [record] = tmp_path.glob("conversation-bench-*.json")
    assert "later-turn hit" in json.loads(record.read_text())["table"]
