"""Speculative decoding on and off, interleaved, on traces whose outputs repeat their context
(``python -m workloads.spec_bench``).

Traces (greedy; prompts rendered with the model's chat template):
- ``rag_quote``: a document (a stdlib docstring) and a request to quote it;
- ``agent_edit``: a source file (a stdlib function) and a request to re-emit it with a rename;
- ``choices``: n = 4 answers to one prompt, sent one after another (regenerations);
- ``same_question``: one question from several users, each under their own system prompt;
- ``json_extract``: a document and a JSON schema (structured outputs) asking for its title,
  its first sentence copied and keywords (an agent's tool arguments quoting its context);
- ``chat``: distinct questions, nothing repeated (the gate must not lose here);
- ``shared_prefix``: distinct questions under one long system prompt.

Each trace runs at a concurrency (requests in flight: 1 and 8 by default) on two engines over
one loaded model, speculation off and ``tree``, A B A B, each repetition in a fresh namespace
(so the tree holds nothing from the previous one). Greedy outputs must be identical: the bench
fails otherwise. "ceiling tok/pass" replays the off engine's answers through the drafter's
sources with free verification, at the run's concurrency, each request in flight decoding one
pass per step (``draft_ceiling``): what the drafts could buy at best, so a shortfall can be told
apart from the cost of the rows. ``--export DIR`` writes each trace's
token ids in the format of ``../shared/peers/vllm_cpu/run_vllm.py --workloads`` (one request
list, generated at once).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

TRACES = ("rag_quote", "agent_edit", "choices", "same_question", "json_extract", "chat",
          "shared_prefix")
REPEATING = ("rag_quote", "agent_edit", "choices", "same_question", "json_extract")
# Traces whose requests are constrained: the JSON schema their answers follow.
EXTRACT_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "first_sentence": {"type": "string"},
                   "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
    "required": ["title", "first_sentence", "keywords"],
}
SCHEMAS = {"json_extract": EXTRACT_SCHEMA}

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Tell me a joke about computers.",
    "What causes the seasons on Earth?",
    "Give me two tips for learning to cook.",
]
EDIT_SOURCES = ("textwrap.dedent", "shlex.quote", "posixpath.join", "textwrap.indent",
                "string.capwords", "glob.escape", "posixpath.normpath", "json.dumps",
                "shlex.split", "posixpath.relpath", "glob.glob", "textwrap.shorten")
USERS = ("Ada", "Grace", "Linus", "Barbara", "Ken", "Dennis", "Alan", "Edsger")


class TraceRun(msgspec.Struct):
    """One trace at one concurrency: medians over the repetitions."""

    trace: str
    concurrency: int
    requests: int
    generated_tokens: int
    off_tok_s: float
    tree_tok_s: float
    speedup: float
    # Median over requests of (tokens - 1) / (latency - time to first token): decode alone.
    off_decode_tok_s: float
    tree_decode_tok_s: float
    decode_speedup: float
    # All requests' decode tokens over their decode seconds, tree / off (median over
    # repetitions): requests that quote more weigh more than in the median request.
    pooled_decode_speedup: float
    draft_tokens: int
    accepted_tokens: int
    # Tokens per decode pass if every pass verified its drafts for free (``draft_ceiling``,
    # at this concurrency).
    ceiling_tokens_per_pass: float
    identical: bool
    runs_off_s: list[float]
    runs_tree_s: list[float]


def build_traces(count: int) -> dict[str, list[list[dict[str, str]]]]:
    """Each trace's conversations, in send order."""
    from workloads.traces.corpus import load_entries

    entries = [e for e in load_entries() if len(" ".join(e.paragraphs)) > 600][:count]
    docs = [" ".join(e.paragraphs)[:1400] for e in entries]
    rag = [[{"role": "user", "content": f"Document:\n{doc}\n\nQuote the document's first two "
             "sentences exactly, word for word."}] for doc in docs]
    edits = []
    for name in EDIT_SOURCES:
        if len(edits) == count:
            break
        module, attr = name.rsplit(".", 1)
        try:
            source = inspect.getsource(getattr(__import__(module, fromlist=[attr]), attr))
        except (OSError, TypeError):  # a C implementation on this Python
            continue
        source = "\n".join(source.splitlines()[:40])
        edits.append([{"role": "user", "content": f"Here is a file:\n```python\n{source}\n```\n"
                       f"Rename the function `{attr}` to `{attr}_v2` and output the whole "
                       "file, unchanged otherwise."}])
    choices = [[{"role": "user", "content": q}] for q in QUESTIONS[: max(1, count // 4)]
               for _ in range(4)]
    same = [[{"role": "system", "content": f"You are {u}'s assistant. Address {u} by name."},
             {"role": "user", "content": "Explain how a hash table works."}]
            for u in USERS[:count]]
    extract = [[{"role": "user", "content": f"Document:\n{doc[:1200]}\n\nReturn JSON with the "
                 "document's title, its first sentence copied exactly, and up to five "
                 "keywords."}] for doc in docs]
    chat = [[{"role": "user", "content": q}] for q in QUESTIONS[:count]]
    system = " ".join(f"Rule {i}: answer politely, cite the source, keep replies short."
                      for i in range(30))
    shared = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
              for q in QUESTIONS[:count]]
    return {"rag_quote": rag, "agent_edit": edits, "choices": choices, "same_question": same,
            "json_extract": extract, "chat": chat, "shared_prefix": shared}


def draft_ceiling(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], k: int,
                  concurrency: int = 1) -> float:
    """Tokens per decode pass if every pass verified ``k`` draft tokens for free, drafting as
    the engine does (a finished sequence this one follows exactly, else the longest n-gram match
    in the request's own tokens, what its running peers generated and the finished sequences;
    one namespace), with ``concurrency`` requests in flight in send order, each decoding one pass
    per step: how far the drafts can carry a trace's answers at best, before any row is paid
    for."""
    from scheduler import Request, SamplingParams
    from scheduler.speculation.drafter import ContextIndex, NamespaceIndex, PeerIndex, best_draft

    finished: list[list[int]] = []
    index, peers = NamespaceIndex(k), PeerIndex()
    waiting = list(sequences)[::-1]
    # Each running request: (request, its context, its answer, tokens of it decoded so far).
    running: list[tuple[Request, ContextIndex, Sequence[int], int]] = []
    passes = decoded = 0
    while waiting or running:
        while waiting and len(running) < concurrency:
            prompt, output = waiting.pop()
            running.append((Request(0, list(prompt), SamplingParams()), ContextIndex(), output,
                            1))  # the first token comes from the prefill pass
        for request, context, output, t in running:
            request.output = list(output[:t])
            context.sync(request)
            peers.add(None, context, len(request.prompt))
        advanced = []
        for request, context, output, t in running:
            if t < len(output):
                seq = context.tokens
                n = len(seq)
                follows = next((e[n : n + k] for e in reversed(finished)
                                if len(e) > n and e[:n] == seq), [])
                draft = best_draft(follows, context, peers, index, None, k).tokens
                draft = draft[: len(output) - t - 1]
                accepted = 0
                while accepted < len(draft) and draft[accepted] == output[t + accepted]:
                    accepted += 1
                passes += 1
                t += accepted + 1
            advanced.append((request, context, output, t))
        running = []
        for request, context, output, t in advanced:
            if t < len(output):
                running.append((request, context, output, t))
                continue
            decoded += max(0, len(output) - 1)
            finished.append([*request.prompt, *output])
            index.add(None, finished[-1])
            peers.remove(context)
    return decoded / passes if passes else 1.0


def run_closed_loop(engine: Any, prompts: Sequence[Any], params: Any, concurrency: int,
                    namespace: str) -> tuple[float, list[list[int]], float, float]:
    """Send ``prompts`` in order with at most ``concurrency`` in flight; wall seconds, the
    outputs' token ids, the median request's decode tokens/s and all requests' decode tokens
    over their decode seconds."""
    outputs: list[list[int]] = [[] for _ in prompts]
    decoded: list[tuple[int, float]] = []  # per request: decode tokens, decode seconds
    lock = threading.Lock()
    queue = list(range(len(prompts)))[::-1]

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                index = queue.pop()
            out = engine.generate([prompts[index]], params, namespace=namespace)[0]
            outputs[index] = list(out.token_ids)
            if out.ttft_s is not None and len(out.token_ids) > 1:
                decoded.append((len(out.token_ids) - 1, out.latency_s - out.ttft_s))

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(min(concurrency, len(prompts)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if not decoded:
        return wall, outputs, 0.0, 0.0
    median = statistics.median(n / s for n, s in decoded)
    return wall, outputs, median, sum(n for n, _ in decoded) / sum(s for _, s in decoded)


def bench_trace(engines: dict[str, Any], name: str, prompts: list[Any], params: Any,
                concurrency: int, repeats: int, k: int,
                log: Callable[[str], None]) -> TraceRun:
    walls: dict[str, list[float]] = {"off": [], "tree": []}
    decode: dict[str, list[float]] = {"off": [], "tree": []}
    pooled: dict[str, list[float]] = {"off": [], "tree": []}
    outs: dict[str, list[list[int]]] = {}
    drafted = accepted = 0
    for rep in range(repeats):
        for mode in ("off", "tree") if rep % 2 == 0 else ("tree", "off"):
            engine = engines[mode]
            before = engine.stats().counters
            wall, got, rate, pool = run_closed_loop(engine, prompts, params, concurrency,
                                                    f"{name}-{concurrency}-{rep}-{mode}")
            pooled[mode].append(pool)
            after = engine.stats().counters
            walls[mode].append(wall)
            decode[mode].append(rate)
            if mode in outs and outs[mode] != got:
                raise AssertionError(f"{name}: {mode} outputs changed between repetitions")
            outs[mode] = got
            if mode == "tree":
                drafted += after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
                accepted += (after.spec_decode_num_accepted_tokens
                             - before.spec_decode_num_accepted_tokens)
            log(f"  {name} c={concurrency} rep {rep} {mode}: {wall:.2f} s")
    identical = outs["off"] == outs["tree"]
    if not identical:
        raise AssertionError(f"{name} c={concurrency}: greedy outputs differ with speculation")
    tokens = sum(len(o) for o in outs["off"])
    ceiling = draft_ceiling(
        [(engines["off"].encode(p), o) for p, o in zip(prompts, outs["off"])], k, concurrency)
    off, tree = statistics.median(walls["off"]), statistics.median(walls["tree"])
    d_off, d_tree = statistics.median(decode["off"]), statistics.median(decode["tree"])
    p_off, p_tree = statistics.median(pooled["off"]), statistics.median(pooled["tree"])
    return TraceRun(name, concurrency, len(prompts), tokens, tokens / off, tokens / tree,
                    off / tree, d_off, d_tree, d_tree / d_off if d_off else 0.0,
                    p_tree / p_off if p_off else 0.0,
                    drafted // repeats, accepted // repeats, ceiling, identical,
                    walls["off"], walls["tree"])


def export_for_vllm(engine: Any, traces: dict[str, list[Any]], directory: Path,
                    output_len: int) -> None:
    """Each trace's prompt ids in run_vllm.py's workload format (its workload A: one request
    list generated at once, greedy, ``ignore_eos``, ``output_len`` tokens)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, prompts in traces.items():
        requests = []
        for i, prompt in enumerate(prompts):
            ids = list(engine.encode(prompt))
            requests.append({"id": f"{name}-{i}", "group": 0, "prefix_len": 0,
                             "prompt": "", "prompt_token_ids": ids})
        body = {"meta": {"trace": name}, "shared_prefix": {
            "output_len": output_len, "groups": 1, "per_group": len(requests),
            "requests": requests}, "multi_turn": {}}
        (directory / f"{name}.json").write_text(json.dumps(body))


def format_table(runs: Sequence[TraceRun]) -> str:
    lines = ["| trace | in flight | requests | tokens | off tok/s | tree tok/s | speedup | "
             "decode tok/s off / tree (per request) | decode speedup | "
             "decode speedup, all requests | accepted / drafted | ceiling tok/pass | identical |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| --- |"]
    for r in runs:
        rate = f"{r.accepted_tokens} / {r.draft_tokens}" if r.draft_tokens else "0 / 0"
        lines.append(f"| {r.trace} | {r.concurrency} | {r.requests} | {r.generated_tokens} | "
                     f"{r.off_tok_s:.1f} | {r.tree_tok_s:.1f} | {r.speedup:.2f}x | "
                     f"{r.off_decode_tok_s:.1f} / {r.tree_decode_tok_s:.1f} | "
                     f"{r.decode_speedup:.2f}x | {r.pooled_decode_speedup:.2f}x | {rate} | "
                     f"{r.ceiling_tokens_per_pass:.2f} | "
                     f"{'yes' if r.identical else 'NO'} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workloads.spec_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", action="append", choices=TRACES, help="default: all")
    p.add_argument("--concurrency", action="append", type=int, help="default: 1 and 8")
    p.add_argument("--requests", type=int, default=8, help="requests per trace (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always max-new-tokens tokens")
    p.add_argument("--repeats", type=int, default=2, help="runs per engine (A B B A ...)")
    p.add_argument("--dtype", default=None, help="default: the engine's choice")
    p.add_argument("--num-speculative-tokens", type=int, default=8)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--export", type=Path, metavar="DIR",
                   help="write the traces' token ids for run_vllm.py and stop")
    p.add_argument("--workloads", type=Path, action="append", metavar="FILE",
                   help="instead of the traces: run_vllm.py workload files (their workload A, "
                   "token ids as they are; repeatable)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.requests < 1 or args.max_new_tokens < 1:
        p.error("--repeats, --requests and --max-new-tokens must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> list[TraceRun]:
    from engine import Engine, SamplingParams, StructuredOutputsParams, load_model

    args = parse_args(argv)
    names = args.trace or list(TRACES)
    traces: dict[str, list[Any]] = {
        n: t for n, t in build_traces(args.requests).items() if n in names
    }
    if args.workloads:
        traces = {path.stem: [r["prompt_token_ids"] for r in
                              json.loads(path.read_text())["shared_prefix"]["requests"]]
                  for path in args.workloads}
        names = list(traces)
    loaded = load_model(None, "auto", args.dtype)
    knobs = dict(model=loaded, num_pages=2048)
    engines = {"off": Engine(**knobs),
               "tree": Engine(**knobs, speculation="tree",
                              num_speculative_tokens=args.num_speculative_tokens)}
    if args.export is not None:
        export_for_vllm(engines["off"], traces, args.export, args.max_new_tokens)
        print(f"wrote {len(traces)} traces to {args.export}")
        return []
    print(f"dtype {loaded.dtype}, speculation in effect: {engines['tree'].speculation}",
          flush=True)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0,
                            ignore_eos=args.ignore_eos)
    trace_params = {name: msgspec.structs.replace(
        params, structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]))
        for name in SCHEMAS}
    for engine in engines.values():  # warm-up: kernels built, threads started
        engine.generate([traces[names[0]][0]], SamplingParams(max_new_tokens=8))
    runs = []
    for concurrency in args.concurrency or [1, 8]:
        for name, prompts in traces.items():
            runs.append(bench_trace(engines, name, prompts, trace_params.get(name, params),
                                    concurrency, args.repeats, args.num_speculative_tokens,
                                    lambda line: print(line, flush=True)))
    for engine in engines.values():
        engine.close()
    print(format_table(runs))
    if args.json is not None:
        args.json.write_text(json.dumps(msgspec.to_builtins(runs), indent=1))
    return runs
