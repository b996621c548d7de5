"""FlashInfer's arguments for one forward pass, planned once from the engine's ForwardBatch.

A pass is attended in at most two FlashInfer calls per layer, planned here once per pass:

- **own**: every request over its own pages (``qo_indptr``, ``kv_indptr``, ``kv_indices``,
  ``kv_last_page_len``, int32), causal with the diagonal at the end of its KV;
- **shared** (cascade, optional): a run of whole pages that several requests hold at the same
  positions (a system prompt, a retrieved document: the radix tree hands out the same page
  ids) is attended once, by the queries of all its members stacked, without a mask: every
  shared page lies before each member's first new token. The own call then covers only each
  request's pages after its shared runs, and the parts are merged by their log-sum-exps
  (``merge_state``), one merge per level of nesting (a system prompt shared by 8 requests,
  then a document shared by 4 of them, is two levels).

The new tokens' K/V are appended with ``append_paged_kv_cache``, whose arguments are the full
page tables (after the append) and each token's request and position. Shared runs are found
with the CPU cascade's trie (``cascade.shared_runs``); everything a layer reads is a tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.attention.cascade import shared_runs
from engine.model.cuda.cascade_rule import SharedRun
from engine.model.device_copy import queued
from engine.model.forward_batch import ForwardBatch, HostTables

# Whether attending these shared runs once (with this many levels) is worth it.
CascadeTest = Callable[[list[SharedRun], int], bool]

# A shared run is attended on its own only when it spares at least this many token reads.
MIN_SAVED_TOKENS = 256


@dataclass
class PagedTables:
    """One FlashInfer call's ragged batch: queries and pages per entry (int32)."""

    qo_indptr: torch.Tensor  # [n + 1]
    kv_indptr: torch.Tensor  # [n + 1]
    kv_indices: torch.Tensor  # [pages]
    kv_last_page_len: torch.Tensor  # [n], 1..page_size
    # The same indptrs and last page lengths on the host, for ``plan`` (None: use the above)
    host: HostTables | None = None

    @property
    def num_entries(self) -> int:
        return int(self.kv_last_page_len.shape[0])

    @property
    def plan_qo_indptr(self) -> torch.Tensor:
        return self.qo_indptr if self.host is None else self.host.qo_indptr

    @property
    def plan_kv_indptr(self) -> torch.Tensor:
        return self.kv_indptr if self.host is None else self.host.kv_indptr

    @property
    def plan_kv_last_page_len(self) -> torch.Tensor:
        return self.kv_last_page_len if self.host is None else self.host.kv_last_page_len


@dataclass
class MergeLevel:
    """Shared runs of one nesting depth: their outputs' rows and the query rows they belong to
    (each query row at most once per level)."""

    shared_rows: torch.Tensor  # int64: rows of the shared call's output
    query_rows: torch.Tensor  # int64: the same queries' rows in the pass


@dataclass
class SharedPrefixes:
    """The cascade's shared call: one entry per run, its members' queries stacked."""

    query_rows: torch.Tensor  # int64: rows of the pass's q, in the shared call's order
    tables: PagedTables  # non-causal, whole pages
    levels: list[MergeLevel]
    num_shared_tokens: int  # KV tokens read once here instead of once per member


@dataclass
class FlashInferPlan:
    """Everything the FlashInfer backend needs for one pass."""

    full: PagedTables  # every request's whole KV: the append's page tables
    own: PagedTables  # what each request attends on its own (its suffix when shared)
    append_batch_indices: torch.Tensor  # int32 [T]: each new token's request
    append_positions: torch.Tensor  # int32 [T]: its position in that request's KV
    shared: SharedPrefixes | None
    decode_shaped: bool  # one query per request in ``own``
    page_size: int


def plan_flashinfer(
    fb: ForwardBatch,
    cascade: bool = True,
    min_saved_tokens: int = MIN_SAVED_TOKENS,
    pays: CascadeTest | None = None,
) -> FlashInferPlan:
    """The plan of pass ``fb``; with ``cascade``, prefixes shared by several requests are
    attended once where that spares at least ``min_saved_tokens`` reads and ``pays`` (the
    device's cost estimate, ``cascade_rule``; None: always) says it is faster."""
    dev = fb.input_ids.device
    ps = fb.page_size
    full = PagedTables(fb.qo_indptr, fb.kv_indptr, fb.kv_indices, fb.kv_last_page_len, fb.host)
    if fb.append_batch_indices is not None and fb.append_positions is not None:
        batch_indices, positions = fb.append_batch_indices, fb.append_positions
    else:
        qo_lens = torch.tensor(fb.qo_lens, dtype=torch.int64, device=dev)
        batch_indices = torch.repeat_interleave(
            torch.arange(fb.batch_size, dtype=torch.int32, device=dev), qo_lens
        )
        positions = fb.positions.to(torch.int32)
    shared = None
    own = full
    if cascade and fb.batch_size > 1:
        found = _shared_prefixes(fb, min_saved_tokens, pays)
        if found is not None:
            shared, own = found
    return FlashInferPlan(full, own, batch_indices, positions, shared, fb.decode_shaped, ps)


def _shared_prefixes(
    fb: ForwardBatch, min_saved_tokens: int, pays: CascadeTest | None
) -> tuple[SharedPrefixes, PagedTables] | None:
    dev = fb.input_ids.device
    ps = fb.page_size
    host = fb.host if fb.host is not None else fb  # page tables read on the host
    indptr = host.kv_indptr.tolist()
    pages = host.kv_indices.tolist()
    tables = [pages[indptr[b] : indptr[b + 1]] for b in range(fb.batch_size)]
    # Only whole pages before a request's first new token can be shared: its new tokens are
    # written into pages of its own.
    before_new = [(kv - n) // ps for n, kv in zip(fb.qo_lens, fb.kv_lens)]
    runs, tail_start = shared_runs(
        [t[:f] for t, f in zip(tables, before_new)], ps, min_saved_tokens
    )
    if not runs:
        return None
    qo_indptr = host.qo_indptr.tolist()
    depth = [0] * fb.batch_size  # shared runs each request is in so far
    query_rows: list[int] = []
    s_qo = [0]
    s_kv = [0]
    s_pages: list[int] = []
    by_level: dict[int, tuple[list[int], list[int]]] = {}
    saved = 0
    # By first page: a run nested in another starts where the outer one ends, so it comes
    # after it, and its members (all in the outer run) are one level deeper.
    for members, a, b in sorted(runs, key=lambda run: run[1]):
        level = depth[members[0]]
        shared_rows, rows_here = by_level.setdefault(level, ([], []))
        for r in members:
            depth[r] += 1
            rows = range(qo_indptr[r], qo_indptr[r + 1])
            shared_rows.extend(range(len(query_rows), len(query_rows) + len(rows)))
            rows_here.extend(rows)
            query_rows.extend(rows)
        s_qo.append(len(query_rows))
        s_pages.extend(tables[members[0]][a:b])
        s_kv.append(len(s_pages))
        saved += (len(members) - 1) * (b - a) * ps
    if pays is not None:
        found = [
            SharedRun(len(m), (b - a) * ps, sum(fb.qo_lens[r] for r in m)) for m, a, b in runs
        ]
        if not pays(found, len(by_level)):
            return None
    own_kv = [0]
    own_pages: list[int] = []
    for r, t in enumerate(tables):
        own_pages.extend(t[tail_start[r] :])
        own_kv.append(len(own_pages))

    # Every table to the device in one copy per dtype, with host copies for ``plan`` (which
    # reads its indptrs on the host: device tensors there cost a synchronisation each).
    (s_qo_t, s_kv_t, s_pages_t, s_last_t, own_kv_t, own_pages_t), i32_host = _tensors(
        dev, torch.int32, [s_qo, s_kv, s_pages, [ps] * (len(s_kv) - 1), own_kv, own_pages]
    )
    row_lists = [query_rows] + [
        rows for _, pair in sorted(by_level.items()) for rows in pair  # (shared, query) rows
    ]
    (query_rows_t, *level_rows), _ = _tensors(dev, torch.int64, row_lists)
    levels = [MergeLevel(a, b) for a, b in zip(level_rows[::2], level_rows[1::2])]
    h_qo, h_kv, h_pages, h_last, h_own_kv, h_own_pages = i32_host
    shared = SharedPrefixes(
        query_rows_t,
        PagedTables(s_qo_t, s_kv_t, s_pages_t, s_last_t, HostTables(h_qo, h_kv, h_last, h_pages)),
        levels,
        saved,
    )
    # A request's own part keeps its last page (its new tokens are there), so its last page's
    # length is unchanged.
    own_host = None
    if fb.host is not None:
        own_host = HostTables(fb.host.qo_indptr, h_own_kv, fb.host.kv_last_page_len, h_own_pages)
    own = PagedTables(fb.qo_indptr, own_kv_t, own_pages_t, fb.kv_last_page_len, own_host)
    return shared, own


def _tensors(
    dev: torch.device, dtype: torch.dtype, groups: list[list[int]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``groups`` as tensors of ``dtype`` on ``dev`` made by one copy (from pinned memory on
    CUDA: asynchronous, where ``torch.tensor(..., device=cuda)`` waits for the stream), and
    the same tensors on the host."""
    sizes = [len(g) for g in groups]
    host, moved = queued(torch.tensor([v for g in groups for v in g], dtype=dtype), dev)
    return list(moved.split(sizes)), list(host.split(sizes))
