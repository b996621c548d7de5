"""The app over engines built in this process: states a server process cannot be put in from
outside (a dead engine loop, a pool small enough to preempt), through the same ASGI app."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from engine import Engine, SamplingParams
from server import ServerConfig, create_app

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Tell me a joke about computers.",
]


def counters(client: TestClient) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_health_answers_503_once_the_engine_is_gone(loaded_fp32: Any) -> None:
    engine = Engine(model=loaded_fp32, num_pages=64)
    with TestClient(create_app(engine)) as client:
        assert client.get("/health").status_code == 200
        engine.close()
        reply = client.get("/health")
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "engine_dead"
        chat = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.status_code == 503 and "error" in chat.json()


def test_metrics_count_each_prompt_once_through_preemption_and_waiting(
    loaded_fp32: Any,
) -> None:
    # 40 pages of 4 tokens hold about three of these requests at once: twelve requests wait
    # many steps, and with no decode reserve running ones outgrow the pool and are preempted
    # and recomputed. Neither may inflate the cache queries or hits (vLLM counted both).
    engine = Engine(
        model=loaded_fp32,
        page_size=4,
        num_pages=40,
        reserve_ratio_init=0.0,
        reserve_margin=0.0,
        reserve_ratio_min=0.0,
    )
    with engine, TestClient(create_app(engine, ServerConfig(model_name="m"))) as client:
        prompts = [[{"role": "user", "content": q}] for q in QUESTIONS] * 2
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0))
        seen = counters(client)
        assert seen["radixkv:num_preemptions_total"] > 0
        assert seen["radixkv:prefix_cache_queries_total"] == sum(o.prompt_tokens for o in outputs)
        assert seen["radixkv:prefix_cache_hits_total"] == sum(o.cached_tokens for o in outputs)
        # Recomputation is real work, counted where it belongs, not as hits.
        computed = seen["radixkv:prefill_computed_tokens_total"]
        misses = (
            seen["radixkv:prefix_cache_queries_total"] - seen["radixkv:prefix_cache_hits_total"]
        )
        assert computed > misses
        assert seen["radixkv:kv_pages_in_use"] == 0


def test_hits_are_labelled_by_the_tier_they_came_from(loaded_fp32: Any) -> None:
    # A pool of about one of these prompts (~37 tokens) over a host tier: each question's
    # own pages are pushed out by the next, and the second round loads them from host.
    engine = Engine(model=loaded_fp32, page_size=4, num_pages=14, kv_host_bytes=1 << 30)
    with engine, TestClient(create_app(engine, ServerConfig(model_name="m"))) as client:
        params = SamplingParams(max_new_tokens=2, temperature=0)
        for question in QUESTIONS * 2:
            engine.generate([[{"role": "user", "content": question}]], params)
        by_source: dict[str, float] = {}
        loaded: dict[str, float] = {}
        for family in text_string_to_metric_families(client.get("/metrics").text):
            for sample in family.samples:
                if sample.name == "radixkv:cached_tokens_total":
                    by_source[sample.labels["cache_source"]] = sample.value
                if sample.name == "radixkv:kv_tier_pages_loaded_total":
                    loaded[sample.labels["tier"]] = sample.value
        stats = engine.stats()
        assert by_source["host"] == stats.counters.cached_tokens_host > 0
        assert by_source["disk"] == 0 and loaded["disk"] == 0
        assert sum(by_source.values()) == counters(client)["radixkv:prefix_cache_hits_total"]
        assert loaded["host"] == stats.tiers.loaded_host > 0


@pytest.mark.parametrize("names", [["a"], ["a", "b"]])
def test_every_served_name_is_listed_and_accepted(loaded_fp32: Any, names: list[str]) -> None:
    engine = Engine(model=loaded_fp32, num_pages=64)
    config = ServerConfig(model_name=names[0], extra_model_names=names[1:])
    with engine, TestClient(create_app(engine, config)) as client:
        listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert listed == names
        for name in names:
            reply = client.post(
                "/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1}
            )
            assert reply.status_code == 200 and reply.json()["model"] == names[0]


def test_speculative_decoding_metrics_use_vllms_names(loaded_fp32: Any) -> None:
    engine = Engine(model=loaded_fp32, num_pages=64, speculation="tree")
    text = "Radix trees share the prefixes of token sequences between requests that begin alike."
    prompt = [{"role": "user", "content": f"Repeat exactly: {text}"}]
    with engine, TestClient(create_app(engine, ServerConfig(model_name="m"))) as client:
        engine.generate([prompt, prompt], SamplingParams(max_new_tokens=24, temperature=0))
        seen = counters(client)
        c = engine.stats().counters
        assert seen["radixkv:spec_decode_num_drafts_total"] == c.spec_decode_num_drafts > 0
        assert seen["radixkv:spec_decode_num_draft_tokens_total"] == c.spec_decode_num_draft_tokens
        accepted = seen["radixkv:spec_decode_num_accepted_tokens_total"]
        assert accepted == c.spec_decode_num_accepted_tokens > 0
        # The per-position family sums (over its position label) to the accepted tokens.
        assert seen["radixkv:spec_decode_num_accepted_tokens_per_pos_total"] == accepted


def test_n_greedy_choices_share_their_rows_and_the_metric_counts_them(loaded_fp32: Any) -> None:
    engine = Engine(model=loaded_fp32, num_pages=64)
    body = {"model": "m", "messages": [{"role": "user", "content": QUESTIONS[2]}],
            "n": 3, "temperature": 0, "max_tokens": 16}
    with engine, TestClient(create_app(engine, ServerConfig(model_name="m"))) as client:
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200
        texts = [c["message"]["content"] for c in reply.json()["choices"]]
        assert len(texts) == 3 and len(set(texts)) == 1
        shared = counters(client)["radixkv:shared_rows_total"]
        assert shared == engine.stats().counters.shared_rows > 0
