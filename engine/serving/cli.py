"""The ``radixkv`` command: ``radixkv chat`` (interactive) and ``radixkv generate "text"``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from engine import Engine, RequestOutput, SamplingParams

HELP_TEXT = """commands: /reset (new conversation), /stats (engine counters), /exit (or Ctrl-D)
Ctrl-C stops a reply that is being generated."""


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--model", default=None,
        help="HF Llama-family checkpoint directory or .gguf file (default: bundled SmolLM2-135M)",
    )
    common.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    common.add_argument(
        "--dtype", default=None,
        help="float32, bfloat16, float16 (default: bfloat16 where fast, else float32)",
    )
    common.add_argument("--max-new-tokens", type=int, default=256, help="per reply (default 256)")
    common.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default), higher = more random"
    )
    common.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0)")
    common.add_argument("--seed", type=int, default=None, help="seed for sampling")

    parser = argparse.ArgumentParser(
        prog="radixkv", description="A prefix-caching LLM inference engine."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chat = commands.add_parser(
        "chat", parents=[common], help="interactive multi-turn chat (streams replies)"
    )
    chat.add_argument("--system", default=None, help="system prompt")
    generate = commands.add_parser(
        "generate", parents=[common], help="generate a continuation of TEXT and print it"
    )
    generate.add_argument("text", help="the prompt")
    generate.add_argument(
        "--raw", action="store_true",
        help="send TEXT as plain text instead of as a user message in the chat template",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine import Engine, SamplingParams

    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"radixkv: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    print("radixkv: loading model ...", file=sys.stderr, flush=True)
    try:
        engine = Engine(model=args.model, device=args.device, dtype=args.dtype)
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
            return run_chat(engine, params, args.system, sys.stdin, sys.stdout)
        return run_generate(engine, params, args.text, args.raw, sys.stdout)


def run_generate(
    engine: Engine, params: SamplingParams, text: str, raw: bool, out: TextIO
) -> int:
    prompt = text if raw else [{"role": "user", "content": text}]
    try:
        events = engine.stream(prompt, params)
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
    engine: Engine, params: SamplingParams, system: str | None, inp: TextIO, out: TextIO
) -> int:
    interactive = inp.isatty()
    if interactive:
        print(HELP_TEXT, file=sys.stderr)
    session = engine.chat(system=system, params=params)
    while True:
        try:
            if interactive:
                line = input("you> ")
            else:
                line = inp.readline()
                if not line:
                    break
                line = line.rstrip("\n")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/help":
            print(HELP_TEXT, file=sys.stderr)
            continue
        if text == "/reset":
            session = engine.chat(system=system, params=params)
            print("[new conversation]", file=sys.stderr)
            continue
        if text == "/stats":
            stats = engine.stats()
            print(
                f"[{stats.requests} requests, hit rate {stats.hit_rate:.1%}, "
                f"{stats.cached_tokens} cached / {stats.computed_prefill_tokens} computed "
                f"prompt tokens, pages free {stats.pages_free} cached {stats.pages_cached} "
                f"of {stats.pages_total}]",
                file=sys.stderr,
            )
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
