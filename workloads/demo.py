"""``make demo``: the bundled model serving a short chat and a RAG batch, cache on vs off.

The chat is four users talking at once under one system prompt (instructions plus reference
notes), three turns each: each turn reuses the user's earlier turns, every user reuses the
system prompt, and their decode steps read it once per step (cascade attention).

Prints a few answers, then a table of prompt tokens, cached tokens, hit rate, wall time and the
speedup of the prefix cache over the same work with the cache off. Greedy decoding, so both
engines give the same answers; the cache only changes how much prefill is computed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from workloads.traces.corpus import Corpus
from workloads.traces.text import TextSource

CHAT_SYSTEM = (
    "You are a concise assistant for Python programmers. Answer in two or three sentences and "
    "name the standard-library functions you would use."
)
CHAT_USERS = (
    (
        "How can I read a JSON file into a dictionary?",
        "And how do I write it back with sorted keys and indentation?",
        "What happens if the file contains a trailing comma?",
    ),
    (
        "How do I turn a Python object into a JSON string?",
        "Can I make the output compact, without spaces?",
        "How do I serialise a datetime value?",
    ),
    (
        "What does json.loads return for a JSON array?",
        "How can I parse numbers as Decimal instead of float?",
        "What error do I get for invalid JSON?",
    ),
    (
        "Is the json module safe for untrusted input?",
        "How do I read a file with one JSON object per line?",
        "How can I pretty-print JSON from the command line?",
    ),
)
RAG_SYSTEM = (
    "Answer the question using only the documentation below. Name the function you rely on."
)
RAG_DOCS: dict[str, tuple[str, ...]] = {
    "textwrap": (
        "How do I wrap a long paragraph to 40 columns?",
        "How can I remove common leading whitespace from a block of text?",
        "How do I shorten a string to fit a width with a placeholder?",
        "How can I add a prefix to every line of a text?",
    ),
    "heapq": (
        "How do I get the three smallest items of a list?",
        "How can I push an item and pop the smallest one in a single call?",
        "How do I merge several sorted inputs into one sorted stream?",
        "How do I turn a list into a heap in place?",
    ),
    "shlex": (
        "How do I split a shell command line into arguments?",
        "How can I quote a file name safely for a shell command?",
        "How do I join a list of arguments back into a command string?",
        "Does shlex treat comments specially?",
    ),
}


class DemoRow(msgspec.Struct):
    job: str
    cache: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _short(text: str, width: int = 220) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def chat_system(doc_tokens: int, tokenizer: Any) -> str:
    """The chat's system prompt: instructions plus reference notes (json's documentation)."""
    source = TextSource(tokenizer, Corpus())
    notes = source.fit(source.corpus.module_document("json"), doc_tokens)
    return f"{CHAT_SYSTEM}\n\nReference notes:\n{notes}"


def run_chat(engine: Any, system: str, params: Any, show: bool) -> DemoRow:
    """Every user's session in its own thread (as a chat backend's handlers would call in);
    prints the first user's turns."""
    from concurrent.futures import ThreadPoolExecutor

    def converse(user: int) -> list[tuple[str, str, int, int]]:
        chat = engine.chat(system=system, params=params)
        turns = []
        for text in CHAT_USERS[user]:
            reply = chat.send(text)
            out = chat.last_output
            turns.append((text, reply, out.prompt_tokens, out.cached_tokens))
        return turns

    started = time.perf_counter()
    with ThreadPoolExecutor(len(CHAT_USERS)) as pool:
        sessions = list(pool.map(converse, range(len(CHAT_USERS))))
    wall = time.perf_counter() - started
    if show:
        for text, reply, prompt_tokens, cached_tokens in sessions[0]:
            print(f"  user: {text}")
            print(f"  assistant: {_short(reply)}")
            print(f"    ({prompt_tokens} prompt tokens, {cached_tokens} from the cache)")
    turns = [t for session in sessions for t in session]
    return DemoRow(
        f"chat, {len(CHAT_USERS)} users x {len(CHAT_USERS[0])} turns", "", len(turns),
        sum(t[2] for t in turns), sum(t[3] for t in turns), wall,
    )


def rag_prompts(doc_tokens: int, tokenizer: Any) -> tuple[list[list[dict[str, str]]], list[str]]:
    source = TextSource(tokenizer, Corpus())
    conversations, questions = [], []
    for module, asks in RAG_DOCS.items():
        document = source.fit(source.corpus.module_document(module), doc_tokens)
        for question in asks:
            conversations.append([
                {"role": "system", "content": f"{RAG_SYSTEM}\n\n{document}"},
                {"role": "user", "content": question},
            ])
            questions.append(question)
    return conversations, questions


def run_rag(engine: Any, conversations: Sequence[Any], params: Any) -> tuple[DemoRow, list[str]]:
    started = time.perf_counter()
    outputs = engine.generate(list(conversations), params)
    wall = time.perf_counter() - started
    row = DemoRow(f"RAG, {len(RAG_DOCS)} docs x 4 questions", "", len(outputs),
                  sum(o.prompt_tokens for o in outputs), sum(o.cached_tokens for o in outputs),
                  wall)
    return row, [o.text for o in outputs]


def format_rows(rows: Sequence[DemoRow], speedups: dict[str, float]) -> str:
    head = ("job", "cache", "requests", "prompt tokens", "cached tokens", "hit rate", "wall s",
            "speedup")
    cells = [(r.job, r.cache, str(r.requests), str(r.prompt_tokens), str(r.cached_tokens),
              f"{r.hit_rate:.0%}", f"{r.wall_s:.1f}",
              f"{speedups[r.job]:.2f}x" if r.cache == "on" else "1.00x") for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[DemoRow]:
    p = argparse.ArgumentParser(prog="python -m workloads.demo", description=__doc__)
    p.add_argument("--model", help="HF checkpoint dir or .gguf (default: the bundled model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--doc-tokens", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for prefill (0: the machine's cores); decode steps run "
                        "on one thread either way (see engine/model/cpu/threads.py)")
    args = p.parse_args(argv)

    started = time.perf_counter()
    import torch

    from engine import Engine, SamplingParams, load_model

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    loaded = load_model(args.model, args.device, args.dtype)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    print(f"model {loaded.source.name} on {loaded.device} ({str(loaded.dtype)[6:]}), "
          f"loaded in {time.perf_counter() - started:.1f} s")
    conversations, questions = rag_prompts(args.doc_tokens, loaded.tokenizer)
    system = chat_system(args.doc_tokens, loaded.tokenizer)

    with Engine(model=loaded, num_pages=64, threads=threads) as warm:  # first-call costs stay out of the timings
        warm.generate([conversations[0]], SamplingParams(max_new_tokens=4, temperature=0.0))
    rows: list[DemoRow] = []
    answers: list[str] = []
    for cache in ("on", "off"):
        with Engine(model=loaded, num_pages=1024, prefix_cache=cache == "on",
                    threads=threads) as engine:
            if cache == "on":
                print(f"\n-- multi-turn chat, {len(CHAT_USERS)} users at once (cache on); "
                      "user 1 --")
            chat = run_chat(engine, system, params, show=cache == "on")
            rag, texts = run_rag(engine, conversations, params)
            chat.cache = rag.cache = cache
            rows += [chat, rag]
            if cache == "on":
                answers = texts
    print(f"\n-- RAG batch: {len(questions)} questions over {len(RAG_DOCS)} shared documents --")
    for i in (0, 5, 10):
        print(f"  Q: {questions[i]}\n  A: {_short(answers[i])}")
    speedups = {}
    for on in (r for r in rows if r.cache == "on"):
        off = next(r for r in rows if r.cache == "off" and r.job == on.job)
        speedups[on.job] = off.wall_s / on.wall_s
    rows.sort(key=lambda r: (r.job, r.cache))
    print("\n" + format_rows(rows, speedups))
    print(f"\ndone in {time.perf_counter() - started:.0f} s")
    return rows


if __name__ == "__main__":
    main()
