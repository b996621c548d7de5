"""The radixkv command, driven as a user would (stdin/stdout), on the shared engine."""

from __future__ import annotations

import io
import re
import subprocess
import sys

from engine_helpers import greedy

from engine.serving.cli import build_parser, run_chat, run_generate


def test_chat_streams_replies_with_a_status_line_per_turn(engine, capsys) -> None:
    stdin = io.StringIO("Hello!\n/stats\nWhat is 2+2?\n/exit\nnever read\n")
    stdout = io.StringIO()
    assert run_chat(engine, greedy(12), None, stdin, stdout) == 0
    replies = [line for line in stdout.getvalue().splitlines() if line.startswith("bot> ")]
    assert len(replies) == 2
    status = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    turns = [line for line in status if line.startswith("[prompt ")]
    assert len(turns) == 2
    cached = [int(re.search(r"(\d+) cached, (\d+) computed", t).group(1)) for t in turns]
    assert cached[1] > cached[0]  # the second turn reuses the first
    assert any("hit rate" in line for line in status)


def test_generate_prints_the_reply(engine, capsys) -> None:
    stdout = io.StringIO()
    assert run_generate(engine, greedy(8), "Say hi", False, stdout) == 0
    assert stdout.getvalue().strip()
    assert "[prompt " in capsys.readouterr().err


def test_parser_knows_the_documented_options() -> None:
    args = build_parser().parse_args(
        ["generate", "text", "--model", "m", "--device", "cpu", "--max-new-tokens", "5",
         "--temperature", "0.5"]
    )
    assert (args.command, args.text, args.model, args.device) == ("generate", "text", "m", "cpu")
    assert (args.max_new_tokens, args.temperature) == (5, 0.5)


def test_help_runs_without_loading_a_model() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "engine.serving.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert "chat" in result.stdout and "generate" in result.stdout
