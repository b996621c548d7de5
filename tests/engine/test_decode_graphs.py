"""The decode graphs' buckets, padding, fixed buffers and scratch page, run on the CPU through
FlashInfer's torch reference (the same code path as on CUDA, without the capture): a padded
graph row gives the logits of the eager pass bit for bit, and K/V lands in the same slots."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flashinfer_cases import flashinfer_runner
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.bringup.platforms import platform_for
from engine.model.cuda.graphs import buckets, pad_index
from engine.model.cuda.step_buffers import StepBuffers
from engine.model.forward_batch import INDEX_FIELDS, ForwardBatch, StepIndex
from engine.model.kv_pool import KVPool
from engine.model.runner import ModelRunner
from scheduler import SamplingParams
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request

PS = 16
PAGES = 96


def test_buckets_are_powers_of_two_to_eight_then_every_eight_to_the_maximum() -> None:
    assert buckets(1) == [1]
    assert buckets(3) == [1, 2, 3]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert buckets(64)[-3:] == [48, 56, 64]
    with pytest.raises(ValueError, match="max_batch"):
        buckets(0)


def _decode_batch(lengths: list[int], first_page: int = 0) -> Batch:
    """One decode entry per request (token 7 after ``n - 1`` cached tokens of 5s), each on
    its own consecutive pages from ``first_page``."""
    entries, page = [], first_page
    for i, n in enumerate(lengths):
        need = -(-n // PS)
        req = Request(i, [5] * (n - 1), SamplingParams(max_new_tokens=2), output=[7])
        entries.append(BatchEntry.on_pages(req, [7], n - 1, list(range(page, page + need)), PS))
        page += need
    return Batch(entries, PS)


def test_padding_rows_sit_on_the_scratch_page_and_every_row_is_sampled() -> None:
    index = StepIndex.of(_decode_batch([3, 20]))
    padded = pad_index(index, 4, scratch_page=99)
    assert padded.kv_indices[-2:] == [99, 99]
    assert padded.kv_indptr == index.kv_indptr + [index.kv_indptr[-1] + 1, index.kv_indptr[-1] + 2]
    assert padded.slots[-2:] == [99 * PS, 99 * PS]
    assert padded.logits_indices == [0, 1, 2, 3]
    assert padded.append_batch_indices == [0, 1, 2, 3]
    assert padded.qo_indptr == [0, 1, 2, 3, 4]
    assert padded.kv_lens[:2] == index.kv_lens
    with pytest.raises(ValueError, match="batch"):
        pad_index(index, 1, scratch_page=99)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=6), st.booleans())
def test_a_packed_step_equals_its_tensors_made_one_by_one(lengths: list[int], fixed: bool) -> None:
    index = StepIndex.of(_decode_batch(lengths))
    capacity = {name: 512 for name, _ in INDEX_FIELDS} if fixed else None
    buffers = StepBuffers("cpu", capacity)
    packed = ForwardBatch.from_index(index, "cpu", buffers)
    plain = ForwardBatch.from_index(index, "cpu")
    for name in ("input_ids", "positions", "slots", "qo_indptr", "kv_indptr", "kv_indices",
                 "kv_last_page_len", "logits_indices"):
        assert torch.equal(getattr(packed, name), getattr(plain, name)), name
    assert packed.append_positions is not None and packed.append_batch_indices is not None
    assert packed.append_positions.tolist() == index.positions
    assert buffers.copies == 1  # one host-to-device copy for the whole pass
    assert packed.host is not None and packed.host.kv_indptr.tolist() == index.kv_indptr


def test_a_fixed_layout_keeps_its_addresses_and_refuses_a_pass_too_large() -> None:
    buffers = StepBuffers("cpu", {name: 8 for name, _ in INDEX_FIELDS})
    first, _ = buffers.pack(StepIndex.of(_decode_batch([3, 20])).values())
    second, _ = buffers.pack(StepIndex.of(_decode_batch([40])).values())
    assert all(first[n].data_ptr() == second[n].data_ptr() for n in first)
    with pytest.raises(ValueError, match="kv_indices"):
        buffers.pack(StepIndex.of(_decode_batch([200])).values())


@pytest.fixture(scope="module")
def runners(loaded_fp32: Any) -> tuple[ModelRunner, ModelRunner]:
    """The same model over two pools of the same pages: eager, and with decode graphs of up
    to 8 entries (buckets 1, 2, 4, 8), both on FlashInfer's reference, deterministic plan."""
    cfg = loaded_fp32.config

    def pool() -> KVPool:
        return KVPool(cfg.num_layers, PAGES, PS, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                      scratch_pages=1)

    eager = flashinfer_runner(loaded_fp32, pool(), batch_invariant=True)
    graphs = flashinfer_runner(loaded_fp32, pool(), batch_invariant=True,
                               cuda_graphs=True, max_batch=8)
    return eager, graphs


def _prefill(runner: ModelRunner, lengths: list[int]) -> None:
    """Writes every request's cached tokens (5s) into its pages, one prefill pass."""
    entries, page = [], 0
    for i, n in enumerate(lengths):
        need = -(-n // PS)
        ids = [5] * (n - 1)
        req = Request(i, ids, SamplingParams(max_new_tokens=2))
        entries.append(BatchEntry.on_pages(req, ids, 0, list(range(page, page + need)), PS))
        page += need
    runner.forward(Batch(entries, PS))


@pytest.mark.parametrize("lengths", [[2], [40, 3], [17, 33, 64], [5, 9, 70, 2, 16, 31]])
def test_a_graph_decode_equals_the_eager_pass_bit_for_bit(
    runners: tuple[ModelRunner, ModelRunner], lengths: list[int]
) -> None:
    eager, graphs = runners
    assert graphs.graphs is not None
    for runner in runners:
        _prefill(runner, lengths)
    batch = _decode_batch(lengths)
    replays = graphs.graphs.replays
    want = eager.forward(batch)
    got = graphs.forward(batch)
    assert graphs.graphs.replays == replays + 1  # it ran in a graph, padded to a bucket
    # not retired: a bucket whose first replay differed would have handed back eager logits
    assert not graphs.graphs.retired
    assert torch.equal(got, want)
    # the new tokens' K/V landed in the same slots
    slots = [e.slots[0] for e in batch.entries]
    for layer in (0, len(eager.pool.k_cache) - 1):
        k_eager = eager.pool.k_cache[layer].view(-1, *eager.pool.k_cache[layer].shape[2:])
        k_graph = graphs.pool.k_cache[layer].view(-1, *graphs.pool.k_cache[layer].shape[2:])
        assert torch.equal(k_graph[slots], k_eager[slots])


def test_passes_a_graph_cannot_hold_run_eagerly(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    _, graphs = runners
    assert graphs.graphs is not None
    before = graphs.graphs.replays
    _prefill(graphs, [30])  # a prefill
    graphs.forward(_decode_batch([2] * 9))  # more entries than the largest bucket
    assert graphs.graphs.replays == before


def test_padding_rows_never_write_a_page_a_request_owns(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    _, graphs = runners
    pool = graphs.pool
    _prefill(graphs, [40, 3, 20])
    before = [k[:PAGES].clone() for k in pool.k_cache]
    batch = _decode_batch([40, 3, 20])  # 3 entries: bucket 4, one padding row
    graphs.forward(batch)
    written = {s // PS for e in batch.entries for s in e.slots}
    for layer, k in enumerate(pool.k_cache):
        changed = (k[:PAGES] != before[layer]).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= written


def test_graphs_need_a_scratch_page_and_the_flashinfer_backend(loaded_fp32: Any) -> None:
    cfg = loaded_fp32.config
    pool = KVPool(cfg.num_layers, 8, PS, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(ValueError, match="scratch page"):
        flashinfer_runner(loaded_fp32, pool, cuda_graphs=True)
    scratch = KVPool(cfg.num_layers, 8, PS, cfg.num_kv_heads, cfg.head_dim, scratch_pages=1)
    with pytest.raises(ValueError, match="flashinfer"):
        ModelRunner(loaded_fp32, scratch, platform_for(loaded_fp32.device), cuda_graphs=True)


def test_the_default_plans_decode_wrapper_runs_in_graph_mode_too(loaded_fp32: Any) -> None:
    """batch_invariant=False: the graphs hold FlashInfer's decode wrapper (its own buffer
    names in graph mode); through the reference its rows equal the eager pass's."""
    cfg = loaded_fp32.config

    def runner(graphs: bool) -> ModelRunner:
        pool = KVPool(cfg.num_layers, PAGES, PS, cfg.num_kv_heads, cfg.head_dim,
                      scratch_pages=1)
        return flashinfer_runner(loaded_fp32, pool, batch_invariant=False,
                                 cuda_graphs=graphs, max_batch=4)

    eager, graphs = runner(False), runner(True)
    assert graphs.graphs is not None
    lengths = [17, 33, 64]
    for r in (eager, graphs):
        _prefill(r, lengths)
    batch = _decode_batch(lengths)
    want = eager.forward(batch)
    got = graphs.forward(batch)
    assert graphs.graphs.replays == 1
    assert torch.equal(got, want)


def _verify_batch(lengths: list[int], drafts: list[int]) -> Batch:
    """Per request, its last token (7) and a draft of ``k`` tokens after ``n - 1`` cached
    tokens of 5s: a verify pass (every row sampled), each request on its own pages."""
    entries, page = [], 0
    for i, (n, k) in enumerate(zip(lengths, drafts)):
        need = -(-(n + k) // PS)
        draft = [11 + j for j in range(k)]
        req = Request(i, [5] * (n - 1), SamplingParams(max_new_tokens=k + 2), output=[7])
        entry = BatchEntry.on_pages(req, [7] + draft, n - 1, list(range(page, page + need)), PS)
        entry.draft = draft
        entries.append(entry)
        page += need
    return Batch(entries, PS)


def test_a_verify_pass_pads_to_a_bucket_with_its_spare_rows_on_the_scratch_page() -> None:
    index = StepIndex.of(_verify_batch([3, 20], [2, 4]))  # 2 entries, 8 rows
    padded = pad_index(index, 4, scratch_page=99, rows=16)  # 2 padding entries: 1 + 7 rows
    assert padded.qo_lens == [3, 5, 1, 7]
    assert padded.qo_indptr == [0, 3, 8, 9, 16]
    assert padded.logits_indices == list(range(16))
    assert padded.positions[8:] == [0] + list(range(7))
    assert padded.kv_indices[len(index.kv_indices):] == [99, 99]
    assert padded.kv_last_page_len[2:] == [1, 7]
    assert padded.append_batch_indices[8:] == [2] + [3] * 7
    assert all(s // PS == 99 for s in padded.slots[8:])
    with pytest.raises(ValueError, match="rows"):
        pad_index(index, 4, scratch_page=99, rows=9)  # no row for the second padding entry
    with pytest.raises(ValueError, match="rows"):
        pad_index(index, 2, scratch_page=99, rows=16)  # spare rows and no entry to hold them


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 70), st.integers(0, 8)), min_size=1, max_size=6),
       st.integers(1, 3), st.integers(0, 40))
def test_a_padded_pass_is_a_consistent_index_whose_real_rows_are_unchanged(
    requests: list[tuple[int, int]], extra_entries: int, spare: int
) -> None:
    index = StepIndex.of(_verify_batch([n for n, _ in requests], [k for _, k in requests]))
    n, r = len(index.qo_lens), len(index.input_ids)
    padded = pad_index(index, n + extra_entries, 99, r + extra_entries + spare)
    rows = r + extra_entries + spare
    assert len(padded.input_ids) == len(padded.positions) == len(padded.slots) == rows
    assert padded.qo_indptr[-1] == rows and len(padded.qo_lens) == n + extra_entries
    assert [b - a for a, b in zip(padded.qo_indptr, padded.qo_indptr[1:])] == padded.qo_lens
    pages = [b - a for a, b in zip(padded.kv_indptr, padded.kv_indptr[1:])]
    assert pages == [-(-kv // PS) for kv in padded.kv_lens]
    assert padded.kv_indptr[-1] == len(padded.kv_indices)
    assert all(1 <= last <= PS for last in padded.kv_last_page_len)
    for name in ("input_ids", "positions", "slots", "append_positions", "append_batch_indices"):
        assert getattr(padded, name)[:r] == getattr(index, name)[:r], name
    assert set(padded.kv_indices[len(index.kv_indices):]) <= {99}


@pytest.mark.parametrize("lengths, drafts", [
    ([40], [3]),
    ([17, 33, 64], [0, 5, 2]),
    ([5, 9, 70, 2, 16, 31, 20], [8, 1, 0, 4, 2, 7, 3]),
])
def test_a_verify_pass_in_a_graph_equals_the_eager_pass_bit_for_bit(
    loaded_fp32: Any, lengths: list[int], drafts: list[int]
) -> None:
    cfg = loaded_fp32.config

    def runner(graphs: bool) -> ModelRunner:
        pool = KVPool(cfg.num_layers, PAGES, PS, cfg.num_kv_heads, cfg.head_dim,
                      scratch_pages=1)
        return flashinfer_runner(loaded_fp32, pool, batch_invariant=True,
                                 cuda_graphs=graphs, max_batch=8, max_verify_rows=8 * 9)

    eager, graphs = runner(False), runner(True)
    assert graphs.graphs is not None
    for r in (eager, graphs):
        _prefill(r, lengths)
    batch = _verify_batch(lengths, drafts)
    shape = graphs.graphs.shape_for(StepIndex.of(batch))
    assert shape is not None and shape[1] > shape[0]  # a verify graph: more rows than entries
    want = eager.forward(batch)
    got = graphs.forward(batch)
    assert graphs.graphs.replays == 1 and not graphs.graphs.retired
    assert got.shape[0] == sum(1 + k for k in drafts)
    assert torch.equal(got, want)
    again = graphs.forward(batch)  # checked at its first replay: now the graph alone
    assert graphs.graphs.replays == 2 and torch.equal(again, want)
    slots = [s for e in batch.entries for s in e.slots]
    for layer in (0, len(eager.pool.k_cache) - 1):
        k_eager = eager.pool.k_cache[layer].view(-1, *eager.pool.k_cache[layer].shape[2:])
        k_graph = graphs.pool.k_cache[layer].view(-1, *graphs.pool.k_cache[layer].shape[2:])
        assert torch.equal(k_graph[slots], k_eager[slots])


def test_verify_passes_beyond_the_graphs_run_eagerly(loaded_fp32: Any) -> None:
    cfg = loaded_fp32.config
    pool = KVPool(cfg.num_layers, PAGES, PS, cfg.num_kv_heads, cfg.head_dim, scratch_pages=1)
    graphs = flashinfer_runner(loaded_fp32, pool, batch_invariant=True,
                               cuda_graphs=True, max_batch=4, max_verify_rows=12).graphs
    assert graphs is not None
    assert graphs.shape_for(StepIndex.of(_verify_batch([9, 9], [2, 2]))) == (4, 8)
    assert graphs.shape_for(StepIndex.of(_verify_batch([9, 9], [5, 5]))) is None  # > 12 rows
    assert graphs.shape_for(StepIndex.of(_verify_batch([9] * 4, [1] * 4))) is None  # no pad entry
    no_verify = flashinfer_runner(loaded_fp32, pool, batch_invariant=True,
                                  cuda_graphs=True, max_batch=4).graphs
    assert no_verify is not None
    assert no_verify.shape_for(StepIndex.of(_verify_batch([9, 9], [2, 2]))) is None
    # the default plan's graphs hold FlashInfer's decode wrapper: one row per entry only
    fast = flashinfer_runner(loaded_fp32, pool, batch_invariant=False,
                             cuda_graphs=True, max_batch=4, max_verify_rows=12).graphs
    assert fast is not None and fast.max_rows == 4
