"""The FlashInfer backend's planning and merging, run on the CPU through FlashInfer's torch
reference: its outputs equal the engine's exact attention on the same pool and batch (prefill,
decode, mixed, cascade over shared and nested prefixes, page sizes 1 and 16), and its K/V
appends land where the engine's own write puts them."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from flashinfer_cases import HKV, HQ, D, build_pass, clone_pool, requests_for, tables_for
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.bringup.platforms import platform_for
from engine.model.cpu import exact_attention
from engine.model.cpu.exact_attention import ExactAttentionBackend
from engine.model.cuda.flashinfer_backend import FlashInferBackend, reference_ops
from engine.model.cuda.flashinfer_plan import plan_flashinfer
from engine.model.cuda.flashinfer_reference import merge_state
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool

CPU = torch.device("cpu")


def flashinfer(fb: ForwardBatch, pool: KVPool, q: Any, k: Any, v: Any, **options: Any) -> Any:
    backend = FlashInferBackend(HQ, HKV, D, CPU, reference_ops(), torch.float32, **options)
    backend.plan(fb)
    return backend.run(0, q, k, v, pool)


def exact(fb: ForwardBatch, pool: KVPool, q: Any, k: Any, v: Any) -> Any:
    kernel = exact_attention.load_kernel()
    if kernel is None:
        pytest.skip("the native attention kernel does not build here")
    backend = ExactAttentionBackend(HQ, HKV, D, CPU, kernel)
    backend.plan(fb)
    return backend.run(0, q, k, v, pool)


def check_equals_exact(
    requests: list[tuple[list[int], int, int]], page_size: int, seed: int = 0, **options: Any
) -> None:
    fb, pool, q, k, v = build_pass(requests, page_size, seed)
    ours_pool = clone_pool(pool)
    ours = flashinfer(fb, ours_pool, q, k, v, **options)
    expected = exact(fb, pool, q, k, v)
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=2e-5)
    # the appended K/V are exactly where the engine's own write put them
    assert torch.equal(ours_pool.k_cache[0], pool.k_cache[0])
    assert torch.equal(ours_pool.v_cache[0], pool.v_cache[0])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", ["prefill", "decode", "mixed", "cascade"])
def test_pass_equals_exact_attention(case: str, page_size: int) -> None:
    check_equals_exact(requests_for(case, page_size), page_size, min_saved_tokens=1)


def test_cascade_reads_a_shared_prefix_once_for_all_its_holders() -> None:
    fb, *_ = build_pass(requests_for("cascade", 16), 16, 0)
    plan = plan_flashinfer(fb, cascade=True, min_saved_tokens=1)
    assert plan.shared is not None and plan.shared.num_shared_tokens == 3 * 64
    assert plan.shared.tables.kv_indices.numel() == 4  # the prefix's pages, once


def test_nested_shared_prefixes_merge_level_by_level() -> None:
    ps = 4
    system = [100, 101, 102, 103]  # shared by all four
    doc_a, doc_b = [110, 111], [120, 121]  # each shared by two
    tables = [
        system + doc_a + [1, 2],
        system + doc_a + [3],
        system + doc_b + [4, 5, 6],
        system + doc_b + [7],
    ]
    requests = [(t, len(t) * ps - 2, 1) for t in tables]
    fb, *_ = build_pass(requests, ps, 1)
    plan = plan_flashinfer(fb, cascade=True, min_saved_tokens=1)
    assert plan.shared is not None
    assert len(plan.shared.levels) == 2  # the system prompt, then the documents
    assert plan.shared.tables.num_entries == 3
    # each request attends on its own only the pages after its shared ones
    assert plan.own.kv_indices.tolist() == [1, 2, 3, 4, 5, 6, 7]
    check_equals_exact(requests, ps, seed=1, min_saved_tokens=1)


def test_pages_being_written_are_never_shared() -> None:
    ps = 4
    # both prefills start inside page 9 and write into it: it cannot be attended as shared
    tables = [[8, 9, 10], [8, 9, 11]]
    requests = [(tables[0], 5, 6), (tables[1], 5, 4)]
    fb, *_ = build_pass(requests, ps, 2)
    plan = plan_flashinfer(fb, cascade=True, min_saved_tokens=1)
    assert plan.shared is not None
    assert plan.shared.tables.kv_indices.tolist() == [8]


def test_without_enough_shared_tokens_there_is_no_cascade() -> None:
    tables = tables_for([40, 40], 16, shared_pages=2)
    fb, *_ = build_pass([(t, 39, 1) for t in tables], 16, 0)
    assert plan_flashinfer(fb, cascade=True).shared is None  # 32 tokens spared < 256
    assert plan_flashinfer(fb, cascade=True, min_saved_tokens=32).shared is not None


def test_append_positions_are_each_tokens_position_in_its_request() -> None:
    tables = tables_for([7, 3, 20], 4)
    fb, *_ = build_pass([(tables[0], 4, 3), (tables[1], 0, 3), (tables[2], 19, 1)], 4, 0)
    plan = plan_flashinfer(fb)
    assert plan.append_batch_indices.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert plan.append_positions.tolist() == [4, 5, 6, 0, 1, 2, 19]
    for t in (plan.full.qo_indptr, plan.full.kv_indices, plan.append_positions):
        assert t.dtype == torch.int32


def test_deterministic_mode_never_cascades_and_still_equals_exact_attention() -> None:
    tables = tables_for([300, 301, 290], 16, shared_pages=16)
    requests = [(t, n - 1, 1) for t, n in zip(tables, [300, 301, 290])]
    fb, *_ = build_pass(requests, 16, 0)
    backend = FlashInferBackend(
        HQ, HKV, D, CPU, reference_ops(), torch.float32, deterministic=True, min_saved_tokens=1
    )
    backend.plan(fb)
    assert backend._plan is not None and backend._plan.shared is None
    check_equals_exact(requests, 16, deterministic=True)


def test_merge_state_of_two_key_sets_is_attention_over_both() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 1, 8, generator=gen)
    k = torch.randn(12, 1, 8, generator=gen) * 2
    v = torch.randn(12, 1, 8, generator=gen)
    from engine.model.cuda.flashinfer_reference import _attend_one

    a, sa = _attend_one(q, k[:7], v[:7], False, 0.5)
    b, sb = _attend_one(q, k[7:], v[7:], False, 0.5)
    whole, s = _attend_one(q, k, v, False, 0.5)
    merged, merged_s = merge_state(a, sa, b, sb)
    torch.testing.assert_close(merged, whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(merged_s, s, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 16),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(1, 5)), min_size=1, max_size=6),
    st.integers(0, 2**16),
)
def test_cascade_never_changes_the_attention_of_any_row(
    page_size: int, shape: list[tuple[int, int, int]], seed: int
) -> None:
    """Requests in up to four prefix families (a family's cached whole pages are shared):
    attention with shared prefixes attended once equals attention without."""
    rng = random.Random(seed)
    family_pages = {f: [1000 + 50 * f + i for i in range(12)] for f in range(4)}
    next_page = 0
    requests = []
    for family, cached, new in shape:
        pages_cached = min(cached // page_size, 12)
        own_pages = -(-(cached + new) // page_size) - pages_cached
        table = family_pages[family][:pages_cached] + list(range(next_page, next_page + own_pages))
        next_page += own_pages
        requests.append((table, cached, new))
    rng.shuffle(requests)
    fb, pool, q, k, v = build_pass(requests, page_size, seed)
    plain = flashinfer(fb, clone_pool(pool), q, k, v, cascade=False)
    shared = flashinfer(fb, clone_pool(pool), q, k, v, min_saved_tokens=1)
    torch.testing.assert_close(shared, plain, atol=2e-5, rtol=2e-5)


def test_the_flashinfer_backend_on_the_cpu_is_its_reference(loaded_fp32: Any) -> None:
    platform = platform_for(CPU, "flashinfer")
    backend = platform.attention_backend("flashinfer", loaded_fp32.config, False, 1, torch.float32)
    assert isinstance(backend, FlashInferBackend)
    assert backend.kernel_name == "flashinfer-reference" and not backend.exact


def test_engine_on_the_flashinfer_backend_answers_as_transformers(
    make_engine: Any, tokenizer: Any, hf_greedy: Any, monkeypatch: Any
) -> None:
    """The whole engine through FlashInfer's planning and merging (its torch reference here):
    four questions under one ~400-token system prompt, cold, then warm, where decodes attend
    the cached system prompt as one shared call; greedy equals transformers' throughout."""
    from engine_helpers import assert_idle_accounting, greedy, under_long_system_prompt

    from engine.model.cuda import flashinfer_backend

    shared_tokens: list[int] = []
    real = flashinfer_backend.plan_flashinfer

    def recording(*args: Any) -> Any:
        plan = real(*args)
        shared_tokens.append(plan.shared.num_shared_tokens if plan.shared else 0)
        return plan

    monkeypatch.setattr(flashinfer_backend, "plan_flashinfer", recording)
    conversations, ids = under_long_system_prompt(tokenizer)
    expected = [hf_greedy(i, 8) for i in ids]
    eng = make_engine(page_size=16, num_pages=160, backend="flashinfer", batch_invariant=False)
    assert eng.attention_kernel == "flashinfer-reference"
    for _ in ("cold", "warm"):
        assert [o.token_ids for o in eng.generate(conversations, greedy(8))] == expected
    assert max(shared_tokens) >= 3 * 384  # the system prompt was read once for all four
    assert_idle_accounting(eng)
