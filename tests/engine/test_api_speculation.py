"""Speculative decoding on the real model: drafts from the radix tree and n-gram lookups,
verified in the decode step. Answers with speculation are the answers without it, token for
token (greedy and seeded, alone and batched, cache on and off, through preemption and chunked
prefill, in both dtypes), because a verify pass computes every row as plain decoding would."""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import CHAT_PROMPTS, assert_idle_accounting, greedy, user
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, SamplingParams
from engine.api import EngineStats
from engine.model.bringup.dtype_probe import probe

PASSAGE = (
    "Radix trees store the prefixes of token sequences once and share them between requests "
    "that begin alike. The engine keeps key and value pages for every cached prefix, and a "
    "request whose prompt starts with a cached prefix computes only the rest."
)
COPY = [
    user(f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"),
    user(f"Here is a document:\n\n{PASSAGE}\n\nQuote its second sentence."),
]


def run(eng: Engine, prompts: list[Any], params: SamplingParams) -> list[Any]:
    return eng.generate(prompts, params)


def assert_same(a: list[Any], b: list[Any]) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [o.text for o in a] == [o.text for o in b]


def drafted(eng: Engine) -> tuple[int, int]:
    c = eng.stats().counters
    return c.spec_decode_num_draft_tokens, c.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_greedy_answers_equal_plain_decoding_alone_and_batched(
    engine: Engine, make_engine: Any, prefix_cache: bool
) -> None:
    prompts = [*COPY, user(CHAT_PROMPTS[0]), user(CHAT_PROMPTS[4])]
    params = greedy(48)
    plain = run(engine, prompts, params)
    spec = make_engine(page_size=16, num_pages=256, speculation="tree", prefix_cache=prefix_cache)
    assert spec.speculation == "tree"
    alone = [run(spec, [p], params)[0] for p in prompts]
    assert_same(alone, plain)
    batched = run(spec, prompts, params)  # again: now the tree holds every answer (cache on)
    assert_same(batched, plain)
    draft_tokens, accepted = drafted(spec)
    assert draft_tokens > 0 and accepted > 0
    assert_idle_accounting(spec)


def test_seeded_sampling_penalties_and_logprobs_equal_plain_decoding(
    engine: Engine, make_engine: Any
) -> None:
    params = SamplingParams(
        max_new_tokens=40, temperature=0.7, top_p=0.95, seed=11, frequency_penalty=0.2,
        logprobs=2,
    )
    plain = run(engine, COPY, params)
    spec = make_engine(num_pages=128, speculation="tree")
    outs = run(spec, COPY, params) + run(spec, COPY, params)
    assert_same(outs[:2], plain)
    assert_same(outs[2:], plain)
    assert [o.logprobs for o in outs[2:]] == [o.logprobs for o in plain]
    assert drafted(spec)[1] > 0


def test_stop_strings_and_length_end_a_request_inside_an_accepted_draft(
    engine: Engine, make_engine: Any
) -> None:
    spec = make_engine(num_pages=128, speculation="tree")
    for params in (greedy(60, stop=["once and share"]), greedy(23), greedy(60, stop=["pages"])):
        plain = run(engine, COPY[:1], params)
        assert_same(run(spec, COPY[:1], params), plain)
        assert_same(run(spec, COPY[:1], params), plain)  # the tree's continuation drafted
    assert drafted(spec)[1] > 0
    assert_idle_accounting(spec)


def test_preemption_and_chunked_prefill_keep_answers(engine: Engine, make_engine: Any) -> None:
    # 56 pages of 4 tokens hold about one and a half of these requests; with no decode
    # reserve the scheduler over-admits, decodes run out of pages and requests are preempted.
    params = greedy(64)
    prompts = [*COPY, *COPY]
    plain = run(engine, prompts, params)
    spec = make_engine(
        page_size=4, num_pages=56, speculation="tree", max_batch_tokens=48, max_running=8,
        reserve_ratio_init=0.0,
        reserve_ratio_min=0.0, reserve_margin=0.0,
    )
    assert_same(run(spec, prompts, params), plain)
    stats = spec.stats().counters
    assert stats.preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert_idle_accounting(spec)


def test_structured_answers_with_drafts_equal_plain_decoding(
    engine: Engine, make_engine: Any
) -> None:
    """Constrained requests are drafted too: each draft row is masked as the grammar stands
    after the drafts before it. The second round drafts from the tree what the first wrote;
    the unconstrained answer in the tree is a draft the JSON grammar refuses at once."""
    from engine import StructuredOutputsParams

    schema = {"type": "object", "properties": {"quote": {"type": "string"}}, "required": ["quote"]}
    kinds = [StructuredOutputsParams(json=schema),
             StructuredOutputsParams(regex=r"[A-Z][a-z]+( [a-z]+){3,12}\."),
             StructuredOutputsParams(choice=["radix trees", "key and value pages"])]
    spec = make_engine(num_pages=256, speculation="tree")
    run(spec, COPY[:1], greedy(24))  # the tree holds an unconstrained answer to COPY[0]
    before = drafted(spec)
    for kind in kinds:
        for params in (greedy(40, structured_outputs=kind),
                       SamplingParams(max_new_tokens=40, temperature=0.8, seed=5,
                                      structured_outputs=kind)):
            plain = run(engine, COPY, params)
            assert_same(run(spec, COPY, params), plain)
            assert_same(run(spec, COPY, params), plain)
    draft_tokens, accepted = (now - then for now, then in zip(drafted(spec), before))
    assert accepted > 0 and draft_tokens > accepted
    assert_idle_accounting(spec)


def test_speculation_is_off_where_passes_are_not_batch_invariant(make_engine: Any) -> None:
    with pytest.warns(UserWarning, match="batch-invariant"):
        eng = make_engine(num_pages=32, speculation="tree", batch_invariant=False)
    assert eng.speculation == "off"


def test_stats_count_drafts_and_sum_them_over_replicas(make_engine: Any) -> None:
    spec = make_engine(num_pages=128, speculation="tree")
    run(spec, COPY[:1] * 2, greedy(32))
    stats = spec.stats()
    c = stats.counters
    per_pos = c.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == spec.config.scheduler.num_speculative_tokens
    assert sum(per_pos) == c.spec_decode_num_accepted_tokens > 0
    assert c.spec_decode_num_drafts > 0 and 0 < c.spec_acceptance_rate <= 1
    both = EngineStats.total([stats, stats])
    assert both.counters.spec_decode_num_accepted_tokens_per_pos == tuple(2 * n for n in per_pos)
    assert stats.to_dict()["counters"]["spec_decode_num_draft_tokens"] == c.spec_decode_num_draft_tokens
    assert EngineStats.zero().counters.spec_decode_num_accepted_tokens_per_pos == ()


WORDS = ["alpha", "beta", "gamma", "delta", "tree", "page", "cache", "token", "fox", "dog"]


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    words=st.lists(st.sampled_from(WORDS), min_size=3, max_size=12),
    times=st.integers(min_value=1, max_value=4),
    k=st.integers(min_value=1, max_value=8),
)
def test_any_prompt_and_draft_cap_give_plain_answers(
    engine: Engine, loaded_fp32: Any, words: list[str], times: int, k: int
) -> None:
    text = " ".join(words * times)
    prompts = [user(f"Say this back: {text}"), user(f"Continue the list: {text}")]
    params = greedy(32)
    plain = run(engine, prompts, params)
    with Engine(model=loaded_fp32, num_pages=96, speculation="tree", num_speculative_tokens=k) as spec:
        assert_same(run(spec, prompts, params), plain)
        assert_same(run(spec, prompts[::-1], params)[::-1], plain)
        assert_idle_accounting(spec)


@pytest.fixture(scope="module")
def loaded_bf16() -> Any:
    from engine.model.bringup.load import load_model

    if probe().reports.get("bfloat16") is None:
        pytest.skip("bfloat16 cannot run on this CPU")
    return load_model(None, "cpu", "bfloat16")


def test_bfloat16_answers_equal_plain_decoding(loaded_bf16: Any) -> None:
    prompts = [*COPY, user(CHAT_PROMPTS[1])]
    params = greedy(40)
    with Engine(model=loaded_bf16, num_pages=128) as plain_engine:
        plain = run(plain_engine, prompts, params)
    with Engine(model=loaded_bf16, num_pages=128, speculation="tree") as spec:
        if not spec.batch_invariant:
            pytest.skip("bfloat16 passes are not verified batch-invariant on this CPU")
        assert_same([run(spec, [p], params)[0] for p in prompts], plain)
        assert_same(run(spec, prompts, params), plain)
        assert drafted(spec)[1] > 0
