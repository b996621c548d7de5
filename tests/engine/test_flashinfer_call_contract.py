"""What FlashInfer's calls need from us beyond their results, checked on the CPU through the
torch reference: a backend in CUDA-graph mode plans the wrapper its graph captured whatever
the pass's shape, ``plan`` gets host tables (the cascade's too), and a packed pass's host
views stay intact while the next pass is packed (FlashInfer copies them asynchronously)."""

from __future__ import annotations

import pytest
import torch
from flashinfer_cases import HKV, HQ, D, build_pass, requests_for

from engine.model.cuda.flashinfer_backend import FlashInferBackend, reference_ops
from engine.model.cuda.flashinfer_plan import plan_flashinfer
from engine.model.cuda.graphs import _empty_index, pad_index
from engine.model.cuda.step_buffers import StepBuffers
from engine.model.forward_batch import INDEX_FIELDS, ForwardBatch, StepIndex
from scheduler import SamplingParams
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request

PS = 16
CPU = torch.device("cpu")


def _decode_index(lengths: list[int]) -> StepIndex:
    entries, page = [], 0
    for i, n in enumerate(lengths):
        need = -(-n // PS)
        req = Request(i, [5] * (n - 1), SamplingParams(max_new_tokens=2), output=[7])
        entries.append(BatchEntry.on_pages(req, [7], n - 1, list(range(page, page + need)), PS))
        page += need
    return StepIndex.of(Batch(entries, PS))


def _fixed_buffers() -> StepBuffers:
    return StepBuffers("cpu", {name: 256 for name, _ in INDEX_FIELDS} | {"kv_indices": 1024})


def test_a_backend_for_a_graph_plans_the_wrapper_it_captured_whatever_the_pass() -> None:
    """The capture pass is all padding (rows of one key: not decode-shaped); a full bucket of
    real decodes is. A graph replays what it captured, so both must plan the same wrapper
    (on CUDA the other one's buffers and schedule would be stale at replay)."""
    for deterministic in (False, True):
        backend = FlashInferBackend(HQ, HKV, D, CPU, reference_ops(), torch.float32,
                                    deterministic=deterministic)
        graph_backend = backend.for_graph(4, 64)
        buffers = _fixed_buffers()
        capture = pad_index(_empty_index(PS), 4, scratch_page=90)
        full = pad_index(_decode_index([3, 20, 17, 40]), 4, scratch_page=90)
        part = pad_index(_decode_index([3, 20]), 4, scratch_page=90)
        assert not capture.decode_shaped and full.decode_shaped
        planned = []
        for index in (capture, full, part):
            graph_backend.plan(ForwardBatch.from_index(index, CPU, buffers))
            planned.append(graph_backend._own)
        want = graph_backend._prefill if deterministic else graph_backend._decode
        assert all(own is want for own in planned), deterministic


def test_the_cascade_hands_plan_its_tables_on_the_host() -> None:
    requests = requests_for("cascade", PS)
    fb, *_ = build_pass(requests, PS, 0)
    index_fb = ForwardBatch.from_index(  # the same pass packed as on CUDA: host tables set
        StepIndex(
            input_ids=fb.input_ids.tolist(), positions=fb.positions.tolist(),
            slots=fb.slots.tolist(), logits_indices=fb.logits_indices.tolist(),
            qo_indptr=fb.qo_indptr.tolist(), kv_indptr=fb.kv_indptr.tolist(),
            kv_last_page_len=fb.kv_last_page_len.tolist(),
            append_batch_indices=[b for b, n in enumerate(fb.qo_lens) for _ in range(n)],
            append_positions=fb.positions.tolist(), kv_indices=fb.kv_indices.tolist(),
            page_size=PS, qo_lens=fb.qo_lens, kv_lens=fb.kv_lens,
            sample_rows=fb.sample_rows, num_scored=0,
        ),
        CPU, StepBuffers("cpu"),
    )
    for batch in (fb, index_fb):
        plan = plan_flashinfer(batch, cascade=True, min_saved_tokens=1)
        assert plan.shared is not None
        tables = plan.shared.tables
        assert tables.host is not None
        for name in ("qo_indptr", "kv_indptr", "kv_last_page_len"):
            assert torch.equal(getattr(tables.host, name), getattr(tables, name)), name
        own = plan.own
        assert (own.host is not None) == (batch.host is not None)
        if own.host is not None:
            assert torch.equal(own.host.kv_indptr, own.kv_indptr)
            assert torch.equal(own.host.kv_indices, own.kv_indices)
            assert torch.equal(own.host.qo_indptr, own.qo_indptr)


def test_a_packed_pass_keeps_its_host_views_while_the_next_pass_is_packed() -> None:
    for capacity in (None, {name: 64 for name, _ in INDEX_FIELDS}):
        buffers = StepBuffers("cpu", capacity)
        first = ForwardBatch.from_index(_decode_index([3, 20]), CPU, buffers)
        assert first.host is not None
        kept = first.host.kv_indptr.clone()
        ForwardBatch.from_index(_decode_index([40, 9, 33]), CPU, buffers)
        assert torch.equal(first.host.kv_indptr, kept)  # not rewritten by the next pack


def test_the_reference_refuses_what_flashinfer_would_misread() -> None:
    """FlashInfer's prefill plan takes head_dim_vo after page_size (a positional ``causal``
    there would be read as it), its run's ``return_lse`` is keyword-only, and a CUDA-graph
    prefill wrapper refuses more query rows than its first plan had."""
    from engine.model.cuda import flashinfer_reference as ref

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    bufs = [torch.zeros(n, dtype=torch.int32) for n in (3, 3, 8, 2)]
    wrapper = ref.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(0), "NHD", use_cuda_graph=True, qo_indptr_buf=bufs[0],
        paged_kv_indptr_buf=bufs[1], paged_kv_indices_buf=bufs[2],
        paged_kv_last_page_len_buf=bufs[3],
    )
    tables = (i32([0, 1, 2]), i32([0, 1, 2]), i32([0, 1]), i32([1, 1]))
    with pytest.raises(TypeError):
        wrapper.plan(*tables, HQ, HKV, D, PS, True)  # type: ignore[misc]
    wrapper.plan(*tables, HQ, HKV, D, PS, causal=True)
    with pytest.raises(ValueError, match="rows"):
        wrapper.plan(i32([0, 2, 3]), *tables[1:], HQ, HKV, D, PS, causal=True)
    cache = torch.zeros(2, PS, HKV, D)
    with pytest.raises(TypeError):
        wrapper.run(torch.zeros(2, HQ, D), (cache, cache), True)  # type: ignore[misc]
