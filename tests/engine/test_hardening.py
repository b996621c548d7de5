"""Defects a new user and an attacker found (issue 17), each pinned by the behaviour it fixes."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import assert_idle_accounting, greedy

from engine import SamplingParams
from engine.serving.detokenizer import IncrementalDetokenizer
from engine.serving.validation import MAX_NAMESPACE_CHARS
from radix import KVManager, RadixCache


def test_a_kv_pool_larger_than_memory_is_a_value_error_before_allocating(make_engine) -> None:
    with pytest.raises(ValueError, match=r"num_pages: 1 pages x .* bytes .* more than the"):
        make_engine(page_size=10**7, num_pages=1)
    with pytest.raises(ValueError, match=r"kv_cache_bytes: .* more than the .* bytes of memory"):
        make_engine(kv_cache_bytes=10**15)


def test_an_empty_namespace_root_is_forgotten() -> None:
    cache = RadixCache(2)
    for i in range(2000):
        cache.insert([1, 2, 3, 4], [2 * i, 2 * i + 1], namespace=f"tenant-{i}")
        cache.evict(2)
    assert cache.namespaces == []
    kv = KVManager(4, 2)
    handle = kv.acquire([5, 6, 7], "one-shot")
    kv.release(handle)  # it cached nothing: its root goes with its last lock
    assert "one-shot" not in kv.tree.namespaces
    kv.check([])


def test_namespace_length_is_limited_at_the_call(engine) -> None:
    with pytest.raises(ValueError, match=rf"namespace: .* limit of {MAX_NAMESPACE_CHARS}"):
        engine.generate("hi", greedy(1), namespace="x" * (MAX_NAMESPACE_CHARS + 1))
    with pytest.raises(ValueError, match="namespace: expected str or None, got int"):
        engine.chat(namespace=5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda e: e.generate("abc\ud800def"), r"prompt: character 3 .* lone surrogate"),
        (lambda e: e.generate([{"role": "user", "content": "x\udfff"}]), r"prompt\[0\]\.content"),
        (lambda e: e.chat().send("hi \ud83d"), r"text: character 3"),
        (lambda e: e.fork("ok", ["\ud800"]), r"suffixes\[0\]: character 0"),
    ],
)
def test_a_lone_surrogate_is_a_value_error_naming_the_index(engine, call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call(engine)


def test_streamed_deltas_concatenate_to_the_text_when_cut_mid_character(tokenizer) -> None:
    ids = tokenizer.encode("Math 𝔘", add_special_tokens=False)
    cut = ids[:-1]  # the last byte of 𝔘 is missing: the text ends in U+FFFD
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in cut] + [detok.finish()]
    assert detok.text.endswith("\ufffd")
    assert "".join(deltas) == detok.text


def test_a_tiny_temperature_is_greedy_not_an_overflow(engine) -> None:
    [tiny] = engine.generate(
        "The capital of France is", SamplingParams(max_new_tokens=8, temperature=1e-40)
    )
    [zero] = engine.generate("The capital of France is", greedy(8))
    assert tiny.token_ids == zero.token_ids
    assert (
        SamplingParams(temperature=1e-6).is_greedy
        and not SamplingParams(temperature=0.01).is_greedy
    )


def test_numpy_integers_are_accepted_wherever_ints_are(engine) -> None:
    params = SamplingParams(
        max_new_tokens=np.int64(4), seed=np.uint32(7), stop_token_ids=[np.int32(2)], temperature=0.0
    )
    [out] = engine.generate([np.int64(1), np.int64(2)], params)
    assert len(out.token_ids) <= 4
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reserve_ratio_init": "a"}, r"reserve_ratio_init: must be a number in \[0, 1\]"),
        ({"model": 123}, r"model: expected a checkpoint directory or .gguf path \(str\), got int"),
        ({"model": ""}, r"model: empty path"),
    ],
)
def test_bad_engine_arguments_are_value_errors_naming_the_field(kwargs, match) -> None:
    from engine import Engine

    with pytest.raises(ValueError, match=match):
        Engine(**kwargs)


def test_the_engine_is_whole_after_the_bad_calls(engine) -> None:
    assert_idle_accounting(engine)
