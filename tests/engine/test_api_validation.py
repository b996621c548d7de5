"""Bad input raises ValueError naming the field and the limit, before anything is queued."""

from __future__ import annotations

import asyncio

import pytest
from engine_helpers import greedy

from engine import Engine, SamplingParams

VOCAB = 49152


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ("", None, r"prompt: empty prompt"),
        ([], None, r"prompts: empty list"),
        ([[]], None, r"prompt: empty prompt"),
        (["ok", ""], None, r"prompts\[1\]: empty prompt"),
        ([[1, 2, VOCAB]], None, rf"prompt\[2\]: token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
        ([[5, -1]], None, r"prompt\[1\]: token id -1 is outside the vocabulary"),
        ([[1, 2.0]], None, r"prompt\[1\]: expected an int token id, got float"),
        ([[1, True]], None, r"prompt\[1\]: expected an int token id, got bool"),
        (42, None, r"prompts: expected str, token ids, chat messages or a list of them, got int"),
        (b"bytes", None, r"prompts: expected .* got bytes"),
        ([3.5], None, r"prompt: expected str, token ids or chat messages, got float"),
        ({"role": "user", "content": "hi"}, None, r"prompts: a single message must be inside a list"),
        ([{"role": "user"}], None, r"prompt\[0\]: message has no 'content'"),
        ([{"role": "user", "content": 3}], None, r"prompt\[0\]\.content: expected str, got int"),
        ([{"role": "", "content": "hi"}], None, r"prompt\[0\]\.role: empty role"),
        ([[1] * 8000], greedy(500), r"prompt: 8000 prompt tokens \+ max_new_tokens 500 = 8500 exceeds the model's context of 8192 tokens"),
        ([[1] * 4000], greedy(200), r"prompt: 4000 prompt tokens \+ max_new_tokens 200 need 4199 KV slots, more than the KV cache's 4096"),
        ("hi", {"max_new_tokens": 3}, r"params: expected SamplingParams or a list of them, got dict"),
        (["a", "b"], [greedy(), greedy(), greedy()], r"params: got 3 SamplingParams for 2 prompts"),
        (["a", "b"], [greedy(), "x"], r"params\[1\]: expected SamplingParams, got str"),
        ("hi", greedy(stop_token_ids=[VOCAB + 5]), rf"params.stop_token_ids: {VOCAB + 5} is not a token id in \[0, {VOCAB}\)"),
    ],
)
def test_generate_rejects_bad_input(engine, prompts, params, match) -> None:
    before = engine.stats().counters.requests
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, params)
    with pytest.raises(ValueError, match=match):
        asyncio.run(engine.agenerate(prompts, params))
    assert engine.stats().counters.requests == before  # nothing was queued


def test_sampling_params_reject_nonsense_at_construction() -> None:
    with pytest.raises(ValueError, match=r"max_new_tokens: must be an integer >= 1"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"top_p: must be in \(0, 1\]"):
        SamplingParams(top_p=0.0)


def test_namespace_must_be_a_string(engine) -> None:
    with pytest.raises(ValueError, match=r"namespace: expected str or None, got int"):
        engine.generate("hi", greedy(), namespace=7)


def test_stream_takes_exactly_one_prompt(engine) -> None:
    with pytest.raises(ValueError, match=r"prompt: expected one prompt, got a list of 2"):
        engine.stream(["a", "b"], greedy())
    with pytest.raises(ValueError, match=r"prompt: empty prompt"):
        engine.stream("", greedy())


def test_fork_and_chat_validate_their_input(engine) -> None:
    with pytest.raises(ValueError, match=r"suffixes: empty list"):
        engine.fork("prefix", [], greedy())
    with pytest.raises(ValueError, match=r"prefix: empty prefix"):
        engine.fork("", ["a"], greedy())
    with pytest.raises(ValueError, match=r"suffixes\[1\]: expected str or token ids, got int"):
        engine.fork("prefix", ["a", 5], greedy())
    with pytest.raises(ValueError, match=rf"suffixes\[0\]\[0\]: token id {VOCAB}"):
        engine.fork("prefix", [[VOCAB]], greedy())
    session = engine.chat()
    with pytest.raises(ValueError, match=r"text: empty message"):
        session.send("")
    with pytest.raises(ValueError, match=r"text: expected str, got list"):
        session.send(["hi"])
    with pytest.raises(ValueError, match=r"system: expected str or None, got int"):
        engine.chat(system=3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"page_size": 0}, r"page_size: must be an int >= 1, got 0"),
        ({"num_pages": 0}, r"num_pages: must be an int >= 1, got 0"),
        ({"num_pages": 8, "kv_cache_bytes": 1 << 20}, r"num_pages, kv_cache_bytes: give at most one"),
        ({"kv_cache_bytes": 1000}, r"kv_cache_bytes: 1000 is less than one page"),
        ({"policy": "random"}, r"policy: must be one of"),
        ({"max_running": 0, "num_pages": 8}, r"max_running: must be an int >= 1"),
        ({"prefix_cache": "yes"}, r"prefix_cache: must be a bool"),
        ({"backend": "cuda-magic", "num_pages": 8}, r"backend: unknown 'cuda-magic'"),
        ({"reserve_ratio": 0.5}, r"reserve_ratio: not an Engine or SchedulerConfig option"),
    ],
)
def test_engine_rejects_bad_configuration(loaded_fp32, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Engine(model=loaded_fp32, **kwargs)


def test_unknown_model_path_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"model: path '/nonexistent/model' does not exist"):
        Engine(model="/nonexistent/model", device="cpu")
