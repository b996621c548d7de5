"""Decode steps replayed from CUDA graphs: the host launches one graph, not ~500 kernels.

Eager, a decode step of a small model is bound by the host launching its kernels, not by the
GPU (the first GPU run's profile: docs/gpu.md). Here a decode pass of ``n`` requests runs as
the graph captured for the smallest bucket ``B >= n`` (1, 2, 4, 8, then every 8 up to
``max_batch``):

- every tensor the captured kernels read lives at a fixed address: the pass's integers in one
  fixed-layout ``StepBuffers`` (filled by one host-to-device copy per step), FlashInfer's
  index buffers in its CUDA-graph wrappers (one wrapper per bucket, filled by ``plan``, which
  runs on the host before each replay and is never captured), the logits in the graph's
  output;
- rows ``n..B-1`` are padding: token 0 at position 0 over the pool's scratch page, which no
  request owns, so their K/V lands there; their logits are dropped;
- mixed and prefill passes, passes that score prompt tokens, entries that do not sample and
  passes beyond the largest bucket or the page capacity run eagerly.

Without CUDA (the CPU, where CI runs) the same buffers, padding, wrappers and plans run
without capture, so everything but the capture itself is tested there, bit for bit against
the eager path. Whether a padded graph row equals an eager one on the device is part of the
start-up check (``device_check``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.cuda.step_buffers import StepBuffers
from engine.model.forward_batch import ForwardBatch, StepIndex
from engine.model.kv_pool import KVPool

# Forward of a planned pass: (forward batch, backend) -> logits of its sampled rows.
Forward = Callable[[ForwardBatch, AttentionBackend], torch.Tensor]


def buckets(max_batch: int) -> list[int]:
    """Graph batch sizes: 1, 2, 4, 8, then every 8 up to ``max_batch`` (itself included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def pad_index(index: StepIndex, batch: int, scratch_page: int) -> StepIndex:
    """``index`` (one token per entry, every entry sampled) padded to ``batch`` entries with
    rows over ``scratch_page``; every row's logits are computed (``logits_indices`` 0..B-1)."""
    n = len(index.qo_lens)
    pad = batch - n
    if pad < 0:
        raise ValueError(f"batch: {batch} is smaller than the pass's {n} entries")
    ps = index.page_size
    last = index.kv_indptr[-1]
    return StepIndex(
        input_ids=index.input_ids + [0] * pad,
        positions=index.positions + [0] * pad,
        slots=index.slots + [scratch_page * ps] * pad,
        logits_indices=list(range(batch)),
        qo_indptr=list(range(batch + 1)),
        kv_indptr=index.kv_indptr + [last + i for i in range(1, pad + 1)],
        kv_last_page_len=index.kv_last_page_len + [1] * pad,
        append_batch_indices=list(range(batch)),
        append_positions=index.append_positions + [0] * pad,
        kv_indices=index.kv_indices + [scratch_page] * pad,
        page_size=ps,
        qo_lens=[1] * batch,
        kv_lens=index.kv_lens + [1] * pad,
        sample_rows=list(range(batch)),
        num_scored=0,
    )


@dataclass
class _Bucket:
    """One batch size's backend (its wrappers' fixed buffers), the all-padding pass it was
    captured with and, on CUDA, its graph and the logits tensor the graph writes."""

    size: int
    backend: AttentionBackend
    forward_batch: ForwardBatch
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None


class DecodeGraphs:
    """Decode passes of up to ``max_batch`` entries through per-bucket graphs.

    ``make_backend(batch, pages)`` builds an attention backend whose wrappers run in graph mode
    for ``batch`` entries and up to ``pages`` pages; ``forward`` runs a planned pass (the
    model's ``forward_planned``). ``max_pages_per_entry`` bounds a request's page table (the
    context over the page size). ``capture``: record CUDA graphs (CUDA only); otherwise each
    bucket's pass runs eagerly over the same static buffers."""

    def __init__(
        self,
        pool: KVPool,
        make_backend: Callable[[int, int], AttentionBackend],
        forward: Forward,
        max_batch: int,
        max_pages_per_entry: int,
        capture: bool,
    ) -> None:
        if pool.scratch_page is None:
            raise ValueError("pool: decode graphs need a scratch page (KVPool(scratch_pages=1))")
        if capture and pool.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA device, the pool is on {pool.device}")
        self.pool = pool
        self.scratch_page = pool.scratch_page
        self.forward = forward
        self.max_batch = max_batch
        self.capture = capture
        self.max_pages = max_batch * max_pages_per_entry
        capacity = {
            "input_ids": max_batch, "positions": max_batch, "slots": max_batch,
            "logits_indices": max_batch, "qo_indptr": max_batch + 1,
            "kv_indptr": max_batch + 1, "kv_last_page_len": max_batch,
            "append_batch_indices": max_batch, "append_positions": max_batch,
            "kv_indices": self.max_pages,
        }
        # One fixed layout for every bucket: bucket B reads the first B entries of each field.
        self.buffers = StepBuffers(pool.device, capacity)
        self.sizes = buckets(max_batch)
        self.replays = 0
        self._buckets: dict[int, _Bucket] = {}
        self._memory_pool = None
        for size in sorted(self.sizes, reverse=True):  # largest first: the others reuse its memory
            backend = make_backend(size, size * max_pages_per_entry)
            fb = self._static_batch(pad_index(_empty_index(pool.page_size), size, self.scratch_page))
            bucket = _Bucket(size, backend, fb)
            if capture:
                self._capture(bucket)
            self._buckets[size] = bucket

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` entries (None: more than the largest)."""
        return next((b for b in self.sizes if b >= n), None)

    def takes(self, index: StepIndex) -> bool:
        """Whether this pass runs in a graph: one token per entry, each sampled once, no
        prompt scoring, and within the buckets and the page capacity."""
        n = len(index.qo_lens)
        return (
            n <= self.max_batch
            and len(index.input_ids) == n
            and index.num_scored == 0
            and index.logits_indices == list(range(n))
            and len(index.kv_indices) + (self.bucket_for(n) or 0) - n <= self.max_pages
        )

    def run(self, index: StepIndex) -> torch.Tensor:
        """Logits ``[n, vocab]`` of the pass ``index`` (``takes(index)`` must hold): a view of
        the graph's output, valid until the next replay."""
        n = len(index.qo_lens)
        size = self.bucket_for(n)
        assert size is not None
        bucket = self._buckets[size]
        padded = pad_index(index, size, self.scratch_page)
        fb = self._static_batch(padded)
        bucket.backend.plan(fb)
        if bucket.graph is None:
            logits = self.forward(fb, bucket.backend)
        else:
            bucket.graph.replay()
            assert bucket.logits is not None
            logits = bucket.logits
        self.replays += 1
        return logits[:n]

    def _static_batch(self, index: StepIndex) -> ForwardBatch:
        """``index`` packed into the fixed buffers: its tensors are views at the same addresses
        for every pass of a bucket, which is what a graph captured."""
        return ForwardBatch.from_index(index, self.pool.device, self.buffers)

    @torch.inference_mode()
    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream (FlashInfer and cuBLAS allocate on first use), then record
        one pass of all-padding rows (no autograd: the weights are parameters)."""
        fb = bucket.forward_batch
        bucket.backend.plan(fb)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(fb, bucket.backend)
        torch.cuda.current_stream().wait_stream(stream)
        if self._memory_pool is None:
            self._memory_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory_pool):
            bucket.logits = self.forward(fb, bucket.backend)
        bucket.graph = graph


def _empty_index(page_size: int) -> StepIndex:
    return StepIndex(
        input_ids=[], positions=[], slots=[], logits_indices=[], qo_indptr=[0], kv_indptr=[0],
        kv_last_page_len=[], append_batch_indices=[], append_positions=[], kv_indices=[],
        page_size=page_size, qo_lens=[], kv_lens=[], sample_rows=[], num_scored=0,
    )
