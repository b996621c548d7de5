"""How many long prefixes a fixed KV budget holds for a model with sliding-window layers,
window-aware (``window_kv_fraction``) vs every layer of every page kept.

The cache itself runs (``KVManager`` with ``WindowSlots``, the pool split as ``build_pool``
splits it); the model does not: what is measured is memory, not speed. Documents of
``--doc-tokens`` random tokens are each asked once with a short question (prefill in chunks,
then a few decoded tokens, as the scheduler steps a request), then each again with a new
question, the most recent first. Reported per model shape and fraction: pool pages and window slots in the budget,
KV bytes per cached token after the first round, documents still hittable in full (the
window before their end has its KV), and the tokens the second round finds cached.

    python -m workloads.model_bench.window [--budget-gib 4] [--docs 120] [--engine]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

from engine.model.bringup.build import split_budget, window_pays
from radix import KVManager
from radix.window import WindowSlots

PAGE = 16
CHUNK = 512  # prefill tokens a step
QUESTION = 32
ANSWER = 16


@dataclass(frozen=True)
class Shape:
    """A model's KV shape: layers, which of them are window layers, one token's KV per layer."""

    name: str
    layers: int
    window_layers: int
    window: int
    kv_heads: int
    head_dim: int
    context: int
    itemsize: int = 2  # bfloat16

    @property
    def layer_page(self) -> int:
        return 2 * PAGE * self.kv_heads * self.head_dim * self.itemsize


SHAPES = [
    # Gemma 3: five window layers per global one
    Shape("gemma3-1b", 26, 22, 512, 1, 256, 32768),
    Shape("gemma3-4b", 34, 29, 1024, 4, 256, 131072),
    # Gemma 2: alternating layers, a 4k window in an 8k context (the engine keeps it whole)
    Shape("gemma2-2b", 26, 13, 4096, 4, 256, 8192),
    # Mistral 7B v0.1: every layer a 4k window
    Shape("mistral-7b", 32, 32, 4096, 8, 128, 32768),
]


@dataclass
class Result:
    pages: int
    slots: int
    bytes_per_token: float
    held: int
    second_round_hit: float


def run(shape: Shape, fraction: float, budget: int, docs: int, doc_tokens: int) -> Result:
    full_layers = shape.layers - shape.window_layers
    if not window_pays(shape.window, shape.context):
        fraction = 0.0  # as the engine decides
    pages, slots = split_budget(budget, shape.layer_page, full_layers, shape.window_layers,
                                fraction, shape.window, PAGE)
    aware = slots > 0
    window = WindowSlots(pages, slots, shape.window, PAGE) if aware else None
    kv = KVManager(pages, PAGE, window=window)
    rng = random.Random(0)
    documents = [[rng.randrange(3, 200_000) for _ in range(doc_tokens)] for _ in range(docs)]

    def ask(doc: list[int]) -> int:
        tokens = doc + [rng.randrange(3, 200_000) for _ in range(QUESTION + ANSWER)]
        handle = kv.acquire(tokens[: len(doc) + QUESTION])
        cached = handle.cached_len
        done = cached
        prompt = len(doc) + QUESTION
        while done < len(tokens):
            n = min(CHUNK, prompt - done) if done < prompt else 1
            kv.slide(handle, done)
            assert kv.allocate(handle, done + n), "the pool cannot hold one request"
            done += n
            if done <= prompt:
                kv.cache(handle, tokens[:done])
        kv.release(handle, tokens[: done - 1])
        return cached

    for doc in documents:
        ask(doc)
    stats = kv.stats()
    cached_tokens = stats.cached * PAGE
    used = stats.cached * full_layers * shape.layer_page if aware else (
        stats.cached * shape.layers * shape.layer_page)
    if window is not None:
        used += (window.num_slots - window.num_free) * shape.window_layers * shape.layer_page
    held = 0
    for doc in documents:
        found = kv.match(doc)
        usable = found.length if window is None else window.usable_length(found.pages, found.length)
        held += usable >= doc_tokens - doc_tokens % PAGE
    hit = sum(ask(doc) for doc in reversed(documents))  # the most recent first
    return Result(pages, slots, used / max(1, cached_tokens) / PAGE * PAGE, held,
                  hit / (docs * doc_tokens))


def run_engine(fraction: float, budget_pages: int, docs: int, doc_tokens: int,
               checkpoint: Path) -> tuple[int, int, float, list[list[int]]]:
    """The same two rounds through the engine, on a tiny random Gemma 3 (window 16, 2 of 3
    layers): (pool pages, window slots, share of the 2nd round's document tokens cached, the
    2nd round's greedy answers)."""
    from engine import Engine, SamplingParams
    from engine.model.bringup.load import load_model
    from engine.model.kv_pool import KVPool

    loaded = load_model(checkpoint, "cpu", "float32")
    cfg = loaded.config
    budget = budget_pages * KVPool.bytes_per_page(
        cfg.num_layers, PAGE, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
    )
    rng = random.Random(0)
    documents = [[rng.randrange(3, 49152) for _ in range(doc_tokens)] for _ in range(docs)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(model=loaded, kv_cache_bytes=budget, page_size=PAGE,
                window_kv_fraction=fraction) as eng:
        for doc in documents:
            eng.generate([doc + [rng.randrange(3, 49152) for _ in range(QUESTION)]], params)
        second = [eng.generate([doc + [7] * QUESTION], params)[0] for doc in reversed(documents)]
        pages = eng.stats().pages
    hit = sum(min(o.cached_tokens, doc_tokens) for o in second) / (docs * doc_tokens)
    return pages.total, pages.window_slots, hit, [o.token_ids for o in second]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--docs", type=int, default=120)
    parser.add_argument("--doc-tokens", type=int, default=4096)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.125, 0.25, 0.5])
    parser.add_argument("--engine", action="store_true",
                        help="also run the engine on a tiny random Gemma 3 (documents of 256 "
                        "tokens, a budget of 512 whole pages)")
    args = parser.parse_args()
    if args.engine:
        engine_rounds(args.fractions)
    budget = int(args.budget_gib * 2**30)
    print(f"budget {args.budget_gib} GiB, bfloat16, page {PAGE}; {args.docs} documents of "
          f"{args.doc_tokens} tokens, each asked twice (question {QUESTION}, answer {ANSWER})")
    print("| model | window_kv_fraction | pool pages | window slots | KV bytes / cached token "
          "| documents held whole | 2nd round cached |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape in SHAPES:
        for fraction in args.fractions:
            r = run(shape, fraction, budget, args.docs, args.doc_tokens)
            print(f"| {shape.name} (window {shape.window}, {shape.window_layers}/{shape.layers}) "
                  f"| {fraction:g} | {r.pages:,} | {r.slots:,} | {r.bytes_per_token:,.0f} "
                  f"| {r.held} | {r.second_round_hit:.0%} |")


def engine_rounds(fractions: list[float]) -> None:
    import tempfile

    from workloads.checkpoints.families import WINDOW, build

    with tempfile.TemporaryDirectory() as tmp:
        build("gemma3", Path(tmp))
        print(f"engine, tiny random Gemma 3 (window {WINDOW}), budget of 512 whole pages of "
              f"{PAGE}, 60 documents of 256 tokens asked twice (2nd round: the most recent first)")
        print("| window_kv_fraction | pool pages | window slots | 2nd round: document tokens "
              "cached | answers = fraction 0's |")
        print("|---:|---:|---:|---:|---|")
        base = None
        for fraction in fractions:
            pages, slots, hit, answers = run_engine(fraction, 512, 60, 256, Path(tmp))
            base = answers if base is None else base
            print(f"| {fraction:g} | {pages:,} | {slots:,} | {hit:.0%} | {answers == base} |")


if __name__ == "__main__":
    main()
