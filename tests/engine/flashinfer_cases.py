"""Passes over a pool of random K/V for the FlashInfer backend's tests (CPU and CUDA), and
runners on FlashInfer's path."""

from __future__ import annotations

import random
from typing import Any

import torch

from engine.model.bringup.platforms import platform_for
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from engine.model.loader import LoadedModel
from engine.model.runner import ModelRunner
from scheduler import SamplingParams
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request

HQ, HKV, D = 9, 3, 64  # the bundled model's heads: 9 query heads over 3 KV heads

# (cached tokens, new tokens) per request: prefill chunks, fresh prompts and decodes together.
MIXED_SHAPES = [(0, 9), (17, 1), (5, 12), (0, 1), (31, 1), (16, 16), (40, 3)]
DECODE_LENGTHS = [1, 2, 17, 64, 65, 300]


def flashinfer_runner(loaded: LoadedModel, pool: KVPool, **options: Any) -> ModelRunner:
    """A runner on the flashinfer backend over ``pool`` (on the CPU its torch reference, the
    CUDA platform's path over the CPU's products), with ``ModelRunner``'s ``options``."""
    platform = platform_for(loaded.device, "flashinfer")
    return ModelRunner(loaded, pool, platform, backend="flashinfer", **options)


def build_pass(
    requests: list[tuple[list[int], int, int]],
    page_size: int,
    seed: int,
    round_to: torch.dtype = torch.float32,
) -> tuple[ForwardBatch, KVPool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """requests: (page table, cached tokens, new tokens). The pool holds random K/V for every
    cached token (shared pages hold the same K/V for every holder, as the radix tree's do);
    returns the pass, the float32 pool, and the new tokens' q, k, v, every value rounded to
    ``round_to`` (so that a copy in that dtype holds exactly the same numbers)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = max(p for t, _, _ in requests for p in t) + 1
    pool = KVPool(1, num_pages, page_size, HKV, D)
    for cache in (pool.k_cache[0], pool.v_cache[0]):
        cache.copy_(torch.randn(cache.shape, generator=gen).to(round_to))
    entries = []
    for i, (table, start, n) in enumerate(requests):
        req = Request(i, [0] * (start + n), SamplingParams(max_new_tokens=4))
        entries.append(BatchEntry.on_pages(req, [0] * n, start, table, page_size))
    fb = ForwardBatch.from_batch(Batch(entries, page_size))
    t = fb.num_tokens
    q, k, v = (
        torch.randn(t, h, D, generator=gen).to(round_to).float() for h in (HQ, HKV, HKV)
    )
    return fb, pool, q, k, v


def clone_pool(
    pool: KVPool, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> KVPool:
    copy = KVPool(1, pool.num_pages, pool.page_size, HKV, D, dtype, device)
    copy.k_cache[0].copy_(pool.k_cache[0])
    copy.v_cache[0].copy_(pool.v_cache[0])
    return copy


def tables_for(lengths: list[int], page_size: int, shared_pages: int = 0) -> list[list[int]]:
    """A page table per request (shuffled ids); the first ``shared_pages`` are the same."""
    need = [-(-n // page_size) - shared_pages for n in lengths]
    ids = list(range(shared_pages + sum(need) + 3))
    random.Random(len(lengths)).shuffle(ids)
    prefix, rest = ids[:shared_pages], ids[shared_pages:]
    tables = []
    for n in need:
        tables.append(prefix + rest[:n])
        rest = rest[n:]
    return tables


def requests_for(case: str, page_size: int) -> list[tuple[list[int], int, int]]:
    """The passes both test files run: ``prefill`` (fresh prompts and prefill chunks),
    ``decode``, ``mixed`` and ``cascade`` (three decodes and a prefill chunk after the same
    cached 64-token prefix)."""
    if case == "prefill":
        shapes = [(s, n) for s, n in MIXED_SHAPES if n > 1]
    elif case == "mixed":
        shapes = MIXED_SHAPES
    elif case == "decode":
        shapes = [(n - 1, 1) for n in DECODE_LENGTHS]
    elif case == "cascade":
        lengths = [70, 90, 66, 130]
        tables = tables_for(lengths, page_size, shared_pages=64 // page_size)
        return [(t, n - 1, 1) for t, n in zip(tables[:3], lengths)] + [(tables[3], 100, 30)]
    else:
        raise ValueError(f"case: unknown {case!r}")
    tables = tables_for([s + n for s, n in shapes], page_size)
    return [(t, s, n) for t, (s, n) in zip(tables, shapes)]
