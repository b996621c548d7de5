"""The ``radixkv`` command: ``radixkv chat`` (interactive) and ``radixkv generate "text"``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

from engine.config import EngineConfig

if TYPE_CHECKING:
    from engine import Engine, SamplingParams
    from engine.api import RequestOutput

HELP_TEXT = """commands: /help (this list), /reset (new conversation), /stats (engine counters),
/exit (or Ctrl-D). Ctrl-C stops a reply that is being generated, or clears the line."""
COMMANDS = ("/help", "/reset", "/stats", "/exit", "/quit")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("radixkv")
    except PackageNotFoundError:
        return "unknown"


def engine_options() -> argparse.ArgumentParser:
    """The flags that build the Engine (``EngineConfig``'s; shared by every command)."""
    options = argparse.ArgumentParser(add_help=False)
    EngineConfig.add_arguments(options)
    return options


def sampling_options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    # Sampling by default: a 135M model decoding greedily soon repeats itself (llama.cpp's
    # defaults, which people know).
    options.add_argument("--max-new-tokens", type=int, default=256, help="per reply (default 256)")
    options.add_argument(
        "--temperature", type=float, default=0.8, help="0 = greedy; default 0.8"
    )
    options.add_argument(
        "--top-p", type=float, default=0.95, help="nucleus sampling (default 0.95)"
    )
    options.add_argument("--top-k", type=int, default=40, help="0 = off (default 40)")
    options.add_argument("--seed", type=int, default=None, help="seed for sampling")
    options.add_argument(
        "--stop", action="append", default=[], metavar="TEXT",
        help="end a reply at TEXT (repeatable)",
    )
    options.add_argument(
        "--namespace", default=None, help="cache namespace: requests never share across them"
    )
    return options


def add_commands(commands: argparse._SubParsersAction) -> None:
    """``chat`` and ``generate`` (the server adds ``serve`` beside them)."""
    parents = [engine_options(), sampling_options()]
    chat = commands.add_parser(
        "chat", parents=parents, help="interactive multi-turn chat (streams replies)"
    )
    chat.add_argument("--system", default=None, help="system prompt")
    generate = commands.add_parser(
        "generate", parents=parents, help="generate a continuation of TEXT and print it"
    )
    generate.add_argument("text", help="the prompt")
    generate.add_argument(
        "--raw", action="store_true",
        help="send TEXT as plain text instead of as a user message in the chat template",
    )


def build_parser(
    more_commands: Callable[[argparse._SubParsersAction], None] | None = None,
) -> argparse.ArgumentParser:
    """The ``radixkv`` parser; ``more_commands`` adds commands of other packages (``serve``)."""
    parser = argparse.ArgumentParser(
        prog="radixkv", description="A prefix-caching LLM inference engine."
    )
    parser.add_argument("--version", action="version", version=f"radixkv {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(commands)
    if more_commands is not None:
        more_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Runs ``chat`` or ``generate`` with parsed arguments."""
    from engine import Engine, SamplingParams

    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=list(args.stop),
        )
    except ValueError as exc:
        print(f"radixkv: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    print("radixkv: loading model ...", file=sys.stderr, flush=True)
    try:
        engine = Engine(EngineConfig.from_args(args))
    except ValueError as exc:
        print(f"radixkv: error: {exc}", file=sys.stderr)
        return 2
    with engine:
        source = args.model or "SmolLM2-135M-Instruct (bundled)"
        print(
            f"radixkv: {source} on {engine.device} ({str(engine.dtype).removeprefix('torch.')}), "
            f"KV cache {engine.num_pages} pages x {engine.page_size} tokens, "
            f"ready in {time.perf_counter() - started:.1f} s",
            file=sys.stderr, flush=True,
        )
        if args.command == "chat":
            return run_chat(engine, params, args.system, sys.stdin, sys.stdout, args.namespace)
        return run_generate(engine, params, args.text, args.raw, sys.stdout, args.namespace)


def run_generate(
    engine: Engine,
    params: SamplingParams,
    text: str,
    raw: bool,
    out: TextIO,
    namespace: str | None = None,
) -> int:
    prompt = text if raw else [{"role": "user", "content": text}]
    try:
        events = engine.stream(prompt, params, namespace)
    except ValueError as exc:
        print(f"radixkv: error: {exc}", file=sys.stderr)
        return 2
    try:
        output = echo_stream(events, out)
    except KeyboardInterrupt:
        events.close()
        print("\n[interrupted]", file=sys.stderr)
        return 130
    out.write("\n")
    if output is not None:
        print(status_line(output), file=sys.stderr)
    return 0


def run_chat(
    engine: Engine,
    params: SamplingParams,
    system: str | None,
    inp: TextIO,
    out: TextIO,
    namespace: str | None = None,
) -> int:
    interactive = inp.isatty()
    if interactive:
        print(HELP_TEXT, file=sys.stderr)
    try:
        session = engine.chat(system=system, params=params, namespace=namespace)
    except ValueError as exc:
        print(f"radixkv: error: {exc}", file=sys.stderr)
        return 2
    while True:
        try:
            if interactive:
                line = input("you> ")
            else:
                line = inp.readline()
                if not line:
                    break
                line = line.rstrip("\n")
        except EOFError:  # Ctrl-D
            print(file=sys.stderr)
            break
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, not an exit
            print(file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/help":
            print(HELP_TEXT, file=sys.stderr)
            continue
        if text == "/reset":
            session = engine.chat(system=system, params=params, namespace=namespace)
            print("[new conversation]", file=sys.stderr)
            continue
        if text == "/stats":
            stats = engine.stats()
            c, pages = stats.counters, stats.pages
            print(
                f"[{c.requests} requests, hit rate {c.hit_rate:.1%}, "
                f"{c.cached_tokens} cached / {c.computed_prefill_tokens} computed "
                f"prompt tokens, pages free {pages.free} cached {pages.cached} "
                f"of {pages.total}]",
                file=sys.stderr,
            )
            continue
        if text.startswith("/") and text.split()[0] not in COMMANDS:
            print(f"[unknown command {text.split()[0]}; /help lists them]", file=sys.stderr)
            continue
        try:
            turn = session.stream(text)
        except ValueError as exc:
            print(f"[error: {exc}]", file=sys.stderr)
            continue
        out.write("bot> ")
        out.flush()
        try:
            output = echo_stream(turn, out)
        except KeyboardInterrupt:
            turn.close()  # aborts the request and frees its pages
            out.write("\n")
            print("[interrupted: reply discarded]", file=sys.stderr)
            continue
        out.write("\n")
        out.flush()
        if output is not None:
            print(status_line(output), file=sys.stderr, flush=True)
    return 0


def echo_stream(events: Iterator[str | RequestOutput], out: TextIO) -> RequestOutput | None:
    """Write a stream's text deltas to ``out`` as they come; returns its final output."""
    output = None
    for item in events:
        if isinstance(item, str):
            out.write(item)
            out.flush()
        else:
            output = item
    return output


def status_line(output: RequestOutput) -> str:
    computed = output.prompt_tokens - output.cached_tokens
    generated = len(output.token_ids)
    decode_s = output.latency_s - (output.ttft_s or 0.0)
    rate = (generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0
    ttft = f"{output.ttft_s:.2f} s" if output.ttft_s is not None else "-"
    return (
        f"[prompt {output.prompt_tokens} tokens: {output.cached_tokens} cached, "
        f"{computed} computed | {generated} generated, {rate:.1f} tok/s | "
        f"first token {ttft} | {output.finish_reason}]"
    )


if __name__ == "__main__":
    raise SystemExit(main())
