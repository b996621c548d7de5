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


class _CtrlCThenLines(io.StringIO):
    """stdin whose first read is a Ctrl-C at the idle prompt."""

    interrupted = False

    def readline(self, *args: object) -> str:
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return super().readline(*args)


def test_unknown_commands_are_not_sent_to_the_model(engine, capsys) -> None:
    before = engine.stats().counters.requests
    stdout = io.StringIO()
    assert run_chat(engine, greedy(4), None, io.StringIO("/frobnicate now\n/exit\n"), stdout) == 0
    assert "unknown command /frobnicate" in capsys.readouterr().err
    assert engine.stats().counters.requests == before and "bot> " not in stdout.getvalue()


def test_ctrl_c_at_the_idle_prompt_clears_the_line_and_the_chat_goes_on(engine) -> None:
    stdout = io.StringIO()
    assert run_chat(engine, greedy(4), None, _CtrlCThenLines("Hello!\n/exit\n"), stdout) == 0
    assert stdout.getvalue().count("bot> ") == 1


def test_help_lists_every_command() -> None:
    from engine.serving.cli import COMMANDS, HELP_TEXT

    assert all(command in HELP_TEXT for command in COMMANDS if command != "/quit")


def test_cli_has_version_and_the_options_people_look_for() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "engine.serving.cli", "--version"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0 and result.stdout.startswith("radixkv ")
    args = build_parser().parse_args(
        ["chat", "--top-k", "5", "--stop", "END", "--stop", "STOP", "--namespace", "t",
         "--num-pages", "64"]
    )
    assert (args.top_k, args.stop, args.namespace, args.num_pages) == (5, ["END", "STOP"], "t", 64)
    defaults = build_parser().parse_args(["chat"])
    assert defaults.temperature > 0 and defaults.top_k > 0  # sampling: greedy loops this model
