"""Decode batches over a pool of random K/V, and the plain attention they must equal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.model.attention.torch_backend import TorchAttentionBackend
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from scheduler import SamplingParams
from scheduler.batch import Batch
from scheduler.request import Request


@dataclass
class DecodeCase:
    """One decode step: request ``b`` has ``lengths[b]`` tokens on pages ``tables[b]``."""

    tables: list[list[int]]
    lengths: list[int]
    page_size: int
    pool: KVPool
    batch: ForwardBatch
    q: torch.Tensor  # [requests, Hq, D]
    k: torch.Tensor  # the new tokens' K/V, as already in the pool
    v: torch.Tensor

    def run(self, num_heads: int) -> tuple[torch.Tensor, TorchAttentionBackend]:
        backend = TorchAttentionBackend(
            num_heads, self.pool.num_kv_heads, self.pool.head_dim, torch.device("cpu")
        )
        backend.plan(self.batch)
        return backend.run(0, self.q, self.k, self.v, self.pool), backend

    def expected(self, b: int) -> torch.Tensor:
        """Softmax attention of request ``b``'s query over all its keys, ``[Hq, D]``."""
        table, n, ps = self.tables[b], self.lengths[b], self.page_size
        idx = torch.tensor([table[t // ps] * ps + t % ps for t in range(n)])
        keys, values = self.pool.k_flat(0)[idx], self.pool.v_flat(0)[idx]
        rep = self.q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        scores = torch.einsum("hd,khd->hk", self.q[b], keys) / self.pool.head_dim**0.5
        return torch.einsum("hk,khd->hd", scores.softmax(-1), values)


def decode_case(
    make_entry: Any,
    tables: list[list[int]],
    lengths: list[int],
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int,
) -> DecodeCase:
    """A pool of random K/V and one decode entry per request (its last token is new)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = max(p for t in tables for p in t) + 1
    pool = KVPool(1, num_pages, page_size, num_kv_heads, head_dim)
    pool.k_cache[0].normal_(generator=gen)
    pool.v_cache[0].normal_(generator=gen)
    entries = [
        make_entry(Request(i, [0] * n, SamplingParams(max_new_tokens=4), output=[1]), [0], n - 1, t, page_size)
        for i, (t, n) in enumerate(zip(tables, lengths))
    ]
    slots = torch.cat([torch.tensor(e.slots) for e in entries])
    k, v = pool.k_flat(0)[slots].clone(), pool.v_flat(0)[slots].clone()
    q = torch.randn(len(tables), num_heads, head_dim, generator=gen)
    batch = ForwardBatch.from_batch(Batch(entries, page_size))
    return DecodeCase(tables, lengths, page_size, pool, batch, q, k, v)


@dataclass
class MixedRun:
    """A batch of prefill chunks and decodes run through the backend, with every request's
    full K/V (cached prefix + new tokens) to check the output against."""

    batch: ForwardBatch
    q: torch.Tensor  # [new tokens, Hq, D]
    out: torch.Tensor
    full_k: list[torch.Tensor]
    full_v: list[torch.Tensor]


def run_mixed_batch(
    make_entry: Any,
    shapes: list[tuple[int, int]],
    tables: list[list[int]],
    num_pages: int,
    page_size: int,
    heads: tuple[int, int, int],
    gen: torch.Generator,
) -> MixedRun:
    """shapes: (cached prefix, new tokens) per request on pages ``tables``; the prefixes are
    written into a fresh pool first, as a prefix-cache hit would have left them."""
    num_heads, num_kv_heads, head_dim = heads
    pool = KVPool(1, num_pages, page_size, num_kv_heads, head_dim)
    entries, full_k, full_v = [], [], []
    for i, ((start, n), table) in enumerate(zip(shapes, tables)):
        k = torch.randn(start + n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(start + n, num_kv_heads, head_dim, generator=gen)
        req = Request(i, list(range(start + n)), SamplingParams(max_new_tokens=4), output=[1] if n == 1 and start > 0 else [])
        if start:
            slots = torch.tensor(make_entry(req, [0] * start, 0, table, page_size).slots)
            pool.k_flat(0)[slots] = k[:start]
            pool.v_flat(0)[slots] = v[:start]
        entries.append(make_entry(req, [0] * n, start, table, page_size))
        full_k.append(k)
        full_v.append(v)
    batch = ForwardBatch.from_batch(Batch(entries, page_size))
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen)
    new_k = torch.cat([k[s:] for k, (s, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[s:] for v, (s, _) in zip(full_v, shapes)])
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, torch.device("cpu"))
    backend.plan(batch)
    out = backend.run(0, q, new_k, new_v, pool)
    return MixedRun(batch, q, out, full_k, full_v)
