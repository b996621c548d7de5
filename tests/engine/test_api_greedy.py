"""A cache hit never changes an answer: greedy outputs equal transformers' greedy generate with
the cache cold, warm, and under memory pressure (eviction and preemption)."""

from __future__ import annotations

import pytest
from engine_helpers import (
    CHAT_PROMPTS,
    assert_idle_accounting,
    greedy,
    under_long_system_prompt,
    user,
)

NEW_TOKENS = 12


def test_greedy_matches_transformers_cold_then_warm(make_engine, chat_ids, hf_greedy) -> None:
    eng = make_engine(page_size=16, num_pages=128)
    prompts = [user(p) for p in CHAT_PROMPTS]
    expected = [hf_greedy(ids, NEW_TOKENS) for ids in chat_ids]

    cold = eng.generate(prompts, greedy(NEW_TOKENS))
    assert [o.token_ids for o in cold] == expected
    assert [o.prompt_tokens for o in cold] == [len(ids) for ids in chat_ids]
    assert eng.stats().counters.cached_tokens < sum(len(ids) for ids in chat_ids) // 2

    warm = eng.generate(prompts, greedy(NEW_TOKENS))
    assert [o.token_ids for o in warm] == expected
    assert [o.text for o in warm] == [o.text for o in cold]
    for out, ids in zip(warm, chat_ids):
        assert out.cached_tokens > 0
        # Everything but the last token's page-aligned part was cached by the cold run.
        assert out.cached_tokens == (len(ids) - 1) // 16 * 16
    assert_idle_accounting(eng)


def test_greedy_matches_transformers_under_memory_pressure(
    make_engine, chat_ids, hf_greedy
) -> None:
    # 40 pages of 4 tokens hold about three of these requests. With no decode reserve at
    # admission, running requests outgrow the pool: the scheduler evicts cached prefixes and
    # preempts (and later resumes) requests.
    eng = make_engine(
        page_size=4, num_pages=40,
        reserve_ratio_init=0.0, reserve_margin=0.0, reserve_ratio_min=0.0,
    )
    prompts = [user(p) for p in CHAT_PROMPTS] * 2
    expected = [hf_greedy(ids, NEW_TOKENS) for ids in chat_ids] * 2

    outs = eng.generate(prompts, greedy(NEW_TOKENS))
    assert [o.token_ids for o in outs] == expected
    stats = eng.stats()
    assert stats.counters.evicted_pages > 0
    assert stats.counters.preemptions > 0
    assert_idle_accounting(eng)


@pytest.mark.parametrize("kernel", ["native", "fast"])
def test_greedy_matches_transformers_when_decodes_share_a_long_prefix(
    make_engine, tokenizer, hf_greedy, monkeypatch, kernel
) -> None:
    """Four questions under one ~400-token system prompt decode together: the shared prefix is
    read once for all four (the native kernel's shared gathers; where the kernel cannot be
    built, the fast backend's cascade) and the answers are still transformers' own."""
    from engine.model.attention import torch_backend
    from engine.model.cpu import exact_attention

    calls = []
    if kernel == "fast":
        monkeypatch.setattr(exact_attention, "load_kernel", lambda: None)
        real = torch_backend.plan_cascade

        def counting(*args, **kwargs):
            plan = real(*args, **kwargs)
            if plan is not None:
                calls.append(max((n for seg in plan.shared for _, n in seg.views), default=0))
            return plan

        monkeypatch.setattr(torch_backend, "plan_cascade", counting)
    else:
        real_plan = exact_attention.plan_native

        def recording(qo_lens, kv_lens, tables, device):
            plan = real_plan(qo_lens, kv_lens, tables, device)
            order, ptr = plan.order.tolist(), plan.item_ptr.tolist()
            seq = plan.q_seq.tolist()
            for a, b in zip(ptr, ptr[1:]):  # tokens of a prefix one item gathers for several
                rows = [tables[seq[t]] for t in order[a:b]]
                if len(rows) > 1 and all(qo_lens[seq[t]] == 1 for t in order[a:b]):
                    common = 0
                    while all(len(r) > common and r[common] == rows[0][common] for r in rows):
                        common += 1
                    calls.append(common * 16)
            return plan

        monkeypatch.setattr(exact_attention, "plan_native", recording)
    conversations, ids = under_long_system_prompt(tokenizer)
    assert len(ids[0]) > 400
    eng = make_engine(page_size=16, num_pages=160)
    assert eng.attention_kernel == kernel
    outs = eng.generate(conversations, greedy(NEW_TOKENS))
    assert [o.token_ids for o in outs] == [hf_greedy(i, NEW_TOKENS) for i in ids]
    assert calls and max(calls) >= 384  # the decodes did read the system prompt once per step
    assert_idle_accounting(eng)
