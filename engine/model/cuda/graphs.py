"""Decode and verify steps replayed from CUDA graphs: the host launches one graph, not ~500
kernels.

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
- a verify pass (speculation: an entry's last token and its draft, every row sampled) runs as
  the graph of ``B`` entries and ``T`` rows: ``B`` the smallest bucket above its entries (one
  padding entry at least), ``T`` the smallest of ``2B, 4B, 8B, 16B`` (each at most
  ``max_rows``) that holds its rows and a row per padding entry; the last padding entry
  takes the spare rows, all on the scratch page. These graphs are captured on first use;
- every bucket's first replay is compared with the eager pass bit for bit (the padding changes
  the pass FlashInfer plans, and a row must not depend on it): a bucket that differs is
  retired with a warning and its passes run eagerly from then on;
- mixed and prefill passes, passes that score prompt tokens, entries that do not sample every
  row and passes beyond the largest bucket or the page capacity run eagerly.

Without CUDA (the CPU, where CI runs) the same buffers, padding, wrappers and plans run
without capture, so everything but the capture itself is tested there, bit for bit against
the eager path. Whether a padded graph row equals an eager one on the device is part of the
start-up check (``device_check``) and of each bucket's first replay.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.cuda.step_buffers import StepBuffers
from engine.model.forward_batch import ForwardBatch, StepIndex
from engine.model.kv_pool import KVPool
from engine.model.platform import EagerPass, PlannedForward

log = logging.getLogger("radixkv.engine")

# A verify graph of B entries holds B times one of these rows (capped by ``max_rows``).
VERIFY_ROW_FACTORS = (2, 4, 8, 16)
# Rows of the largest verify graph (its logits: rows x vocabulary floats, ~100 MB at 512).
MAX_VERIFY_ROWS = 512


def buckets(max_batch: int) -> list[int]:
    """Graph batch sizes: 1, 2, 4, 8, then every 8 up to ``max_batch`` (itself included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def pad_index(index: StepIndex, batch: int, scratch_page: int, rows: int | None = None) -> StepIndex:
    """``index`` (every row sampled) padded to ``batch`` entries and ``rows`` rows (default:
    one per entry) with entries over ``scratch_page``: one row each, the last one taking the
    spare rows; every row's logits are computed (``logits_indices`` 0..rows-1)."""
    n = len(index.qo_lens)
    rows = batch if rows is None else rows
    pad, spare = batch - n, rows - len(index.input_ids)
    if pad < 0:
        raise ValueError(f"batch: {batch} is smaller than the pass's {n} entries")
    if spare < pad or (pad == 0 and spare > 0):
        raise ValueError(
            f"rows: {rows} cannot hold the pass's {len(index.input_ids)} rows and a row for "
            f"each of its {pad} padding entries"
        )
    ps = index.page_size
    pad_rows = [1] * (pad - 1) + [spare - (pad - 1)] if pad else []
    positions, slots, pages, last_lens, entries = [], [], [], [], []
    kv_indptr = list(index.kv_indptr)
    qo_indptr = list(index.qo_indptr)
    for k, m in enumerate(pad_rows):
        positions += range(m)
        slots += [scratch_page * ps + j % ps for j in range(m)]
        used = -(-m // ps)
        pages += [scratch_page] * used
        last_lens.append(m - (used - 1) * ps)
        kv_indptr.append(kv_indptr[-1] + used)
        qo_indptr.append(qo_indptr[-1] + m)
        entries += [n + k] * m
    return StepIndex(
        input_ids=index.input_ids + [0] * spare,
        positions=index.positions + positions,
        slots=index.slots + slots,
        logits_indices=list(range(rows)),
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        kv_last_page_len=index.kv_last_page_len + last_lens,
        append_batch_indices=index.append_batch_indices + entries,
        append_positions=index.append_positions + positions,
        kv_indices=index.kv_indices + pages,
        page_size=ps,
        qo_lens=index.qo_lens + pad_rows,
        kv_lens=index.kv_lens + pad_rows,
        sample_rows=list(range(batch)),
        num_scored=0,
    )


@dataclass
class _Bucket:
    """One batch size's backend (its wrappers' fixed buffers), the all-padding pass it was
    captured with and, on CUDA, its graph and the logits tensor the graph writes."""

    size: int
    rows: int
    backend: AttentionBackend
    forward_batch: ForwardBatch
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    checked: bool = False  # its first replay equalled the eager pass


class DecodeGraphs:
    """Decode passes of up to ``max_batch`` entries, and verify passes of up to ``max_rows``
    rows, through per-bucket graphs (the CUDA platform's ``GraphedPasses``).

    ``make_backend(batch, pages)`` builds an attention backend whose wrappers run in graph mode
    for ``batch`` entries and up to ``pages`` pages; ``forward`` runs a planned pass (the
    model's ``forward_planned``); ``eager`` runs a pass as the runner would without graphs
    (each bucket's first replay is compared with it). ``max_pages_per_entry`` bounds a
    request's page table (the context over the page size). ``max_rows``: rows of the largest
    verify graph (0 or ``max_batch``: no verify graphs; they need a backend whose graph
    wrappers take several rows per entry, FlashInfer's prefill wrapper). ``capture``: record
    CUDA graphs (CUDA only); otherwise each bucket's pass runs over the same static buffers
    without capture."""

    def __init__(
        self,
        pool: KVPool,
        make_backend: Callable[[int, int], AttentionBackend],
        forward: PlannedForward,
        max_batch: int,
        max_pages_per_entry: int,
        capture: bool,
        eager: EagerPass | None = None,
        max_rows: int = 0,
    ) -> None:
        if pool.scratch_page is None:
            raise ValueError("pool: decode graphs need a scratch page (KVPool(scratch_pages=1))")
        if capture and pool.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA device, the pool is on {pool.device}")
        self.pool = pool
        self.scratch_page = pool.scratch_page
        self.make_backend = make_backend
        self.forward = forward
        self.eager = eager
        self.max_batch = max_batch
        self.max_rows = max(max_rows, max_batch)
        self.capture = capture
        self.max_pages_per_entry = max_pages_per_entry
        self.max_pages = self._pages(max_batch, self.max_rows)
        rows, entries = self.max_rows, max_batch
        capacity = {
            "input_ids": rows, "positions": rows, "slots": rows, "logits_indices": rows,
            "qo_indptr": entries + 1, "kv_indptr": entries + 1, "kv_last_page_len": entries,
            "append_batch_indices": rows, "append_positions": rows, "kv_indices": self.max_pages,
        }
        # One fixed layout for every bucket: a bucket reads the first entries of each field.
        self.buffers = StepBuffers(pool.device, capacity)
        self.sizes = buckets(max_batch)
        self.replays = 0
        self.retired: set[tuple[int, int]] = set()
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._memory_pool = None
        for size in sorted(self.sizes, reverse=True):  # largest first: the others reuse its memory
            self._buckets[(size, size)] = self._build(size, size)

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` entries (None: more than the largest)."""
        return next((b for b in self.sizes if b >= n), None)

    def shape_for(self, index: StepIndex) -> tuple[int, int] | None:
        """The graph (entries, rows) that holds ``index``, or None: it runs eagerly."""
        n, r = len(index.qo_lens), len(index.input_ids)
        # logits rows ascend within and across entries: r of them are every row
        if index.num_scored or len(index.logits_indices) != r:
            return None  # a prefill chunk's rows, or prompt rows scored
        if r == n:
            size = self.bucket_for(n)
            shape = None if size is None else (size, size)
        else:
            size = self.bucket_for(n + 1)  # a padding entry takes the spare rows
            if size is None:
                return None
            need = r + size - n
            # the largest verify graph is ``max_rows`` itself when a factor's would exceed it
            sizes = [min(size * f, self.max_rows) for f in VERIFY_ROW_FACTORS]
            rows = next((t for t in sizes if need <= t), None)
            shape = None if rows is None else (size, rows)
        if shape is None or shape in self.retired:
            return None
        size, rows = shape
        pad = size - n
        spare_pages = pad - 1 + -(-(rows - r - (pad - 1)) // self.pool.page_size) if pad else 0
        if len(index.kv_indices) + spare_pages > self._pages(size, rows):
            return None
        return shape

    def run(self, index: StepIndex, shape: tuple[int, int]) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the pass ``index`` in the graph ``shape_for(index)``
        gave: a view of the graph's output, valid until the next replay (or the eager pass's
        logits, the one time a bucket's first replay differs from them)."""
        bucket = self._buckets.get(shape)
        if bucket is None:
            bucket = self._buckets[shape] = self._build(*shape)
        padded = pad_index(index, bucket.size, self.scratch_page, bucket.rows)
        fb = self._static_batch(padded)
        bucket.backend.plan(fb)
        if bucket.graph is None:
            logits = self.forward(fb, bucket.backend)
        else:
            bucket.graph.replay()
            assert bucket.logits is not None
            logits = bucket.logits
        self.replays += 1
        got = logits[: len(index.input_ids)]
        if bucket.checked or self.eager is None:
            return got
        want = self.eager(index)  # writes the same K/V again: the eager pass's, if they differ
        if torch.equal(got, want):
            bucket.checked = True
            return got
        self.retired.add(shape)
        del self._buckets[shape]
        message = (
            f"cuda_graphs: the graph of {shape[0]} entries and {shape[1]} rows gave logits that "
            "differ from the eager pass's; passes of that shape run eagerly"
        )
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return want

    def _build(self, size: int, rows: int) -> _Bucket:
        """A bucket's backend, its all-padding pass (of ``rows`` rows: FlashInfer's graph
        wrapper keeps the first plan's row count as its most) and, on CUDA, its graph."""
        backend = self.make_backend(size, self._pages(size, rows))
        empty = _empty_index(self.pool.page_size)
        fb = self._static_batch(pad_index(empty, size, self.scratch_page, rows))
        bucket = _Bucket(size, rows, backend, fb)
        if self.capture:
            self._capture(bucket)
        return bucket

    def _pages(self, size: int, rows: int) -> int:
        """Page-table room of the graph (``size`` entries, ``rows`` rows): its entries' pages,
        plus the scratch page once per padding entry and per page of spare rows."""
        return size * self.max_pages_per_entry + size + -(-rows // self.pool.page_size)

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
