"""The remote KV tier on a real Redis server (started here on a free loopback port): pages round
trip bit for bit, damaged and foreign values are misses, a dead server is misses (and comes
back), and two engines on one server share prefixes, per tenant, with the answers of no cache.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import assert_idle_accounting, greedy
from redis_server import free_port, redis_server

from engine import Engine
from engine.serving.kv_remote import RedisClient
from radix.tiers import PageRecord, RemoteStore
from radix.tiers.remote import RETRY_AFTER_S

DOC = " ".join(f"Clause {i}: the tenant pays {i * 7} credits by day {i + 3}." for i in range(30))
PROMPTS = [f"{DOC}\nQuestion {q}: which clause costs most?" for q in range(3)]
NEW = 4


def _records(n: int) -> list[PageRecord]:
    return [PageRecord(1000 + i, bytes([i]) * 32, bytes(range(256)) * (i + 1)) for i in range(n)]


def test_pages_round_trip_bit_for_bit_and_damage_is_a_miss(tmp_path: Path) -> None:
    with redis_server(tmp_path) as (url, _):
        store = RemoteStore(RedisClient(url), "model-a")
        records = _records(5)
        assert all(store.put(r) for r in records)
        assert store.flush()
        keys = [r.key for r in records]
        assert store.contains_many(keys + [1]) == [True] * 5 + [False]
        assert store.get_many(keys, [r.tokens for r in records]) == records
        assert store.written == 5 and store.read == 5
        # another model's store and other tokens under the same key are misses
        other = RemoteStore(RedisClient(url), "model-b")
        assert other.contains_many(keys) == [False] * 5
        assert store.get_many(keys[:1], [b"x" * 32]) == [None]
        # a damaged value (a bit flipped) and a value moved under another key: misses, counted
        raw = RedisClient(url)
        value = raw.get_many([store.key_of(keys[1])])[0]
        assert value is not None
        flipped = bytearray(value)
        flipped[40] ^= 1
        raw.set_many([(store.key_of(keys[1]), bytes(flipped)), (store.key_of(keys[2]), value)])
        got = store.get_many(keys[1:3], [r.tokens for r in records[1:3]])
        assert got == [None, None] and store.corrupt == 3  # the wrong tokens above, then two
        other.close()
        store.close()


def test_a_dead_server_is_a_miss_and_is_tried_again_later(tmp_path: Path) -> None:
    with redis_server(tmp_path) as (url, proc):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        store = RemoteStore(RedisClient(url), "model-a", retry_after_s=0.3)
        records = _records(2)
        store.put(records[0])
        assert store.flush()
        proc.kill()
        proc.wait()
        started = time.monotonic()
        assert store.contains_many([records[0].key]) is None
        assert store.contains_many([records[0].key]) is None  # closed: not even asked
        assert time.monotonic() - started < 2.0
        assert store.errors == 1 and not store.available
        assert not store.put(records[1]) and store.dropped == 1
    with redis_server(tmp_path, port=port) as (url, _):
        time.sleep(0.35)
        assert store.available
        assert store.put(records[1]) and store.flush()
        assert store.contains_many([records[1].key]) == [True]
        store.close()


@pytest.fixture(scope="module")
def reference(loaded_fp32: Any) -> list[list[int]]:
    with Engine(model=loaded_fp32, num_pages=256, prefix_cache=False) as eng:
        return [out.token_ids for out in eng.generate(PROMPTS, greedy(NEW))]


def test_a_second_engine_hits_what_the_first_computed_per_tenant(
    make_engine: Any, reference: list[list[int]], tmp_path: Path
) -> None:
    with redis_server(tmp_path) as (url, _):
        first = make_engine(num_pages=128, kv_remote=url)
        assert [o.token_ids for o in first.generate(PROMPTS[:1], greedy(NEW))] == reference[:1]
        assert first.wait_idle(timeout=60)
        remote = first._loop._kv.tiers.remote
        assert remote.flush()  # the writes are asynchronous: wait for them here
        assert remote.written > 0 and remote.dropped == 0
        # an idle engine's stats say what its writer has sent since the last step
        assert first.stats().tiers.written_remote == remote.written
        second = make_engine(num_pages=128, kv_remote=url)
        stranger = second.generate(PROMPTS[1:2], greedy(NEW), namespace="tenant-b")[0]
        assert stranger.token_ids == reference[1] and stranger.cached_tokens == 0
        outs = second.generate(PROMPTS[1:], greedy(NEW))
        assert [o.token_ids for o in outs] == reference[1:]
        stats = second.stats()
        assert stats.tiers.loaded_remote > 0 and stats.counters.cached_tokens_remote > 0
        assert outs[0].cached_tokens > len(DOC) // 8  # most of the document, from Redis
        assert_idle_accounting(second)
        assert_idle_accounting(first)


def test_an_unreachable_server_costs_misses_not_requests(
    make_engine: Any, reference: list[list[int]]
) -> None:
    eng = make_engine(num_pages=128, kv_remote=f"redis://127.0.0.1:{free_port()}/0")
    assert [o.token_ids for o in eng.generate(PROMPTS, greedy(NEW))] == reference
    stats = eng.stats()
    assert stats.tiers.remote and stats.tiers.remote_errors >= 1
    assert stats.counters.cached_tokens_remote == 0
    assert_idle_accounting(eng)


def test_kv_remote_must_be_a_redis_url() -> None:
    with pytest.raises(ValueError, match="kv_remote: expected redis://"):
        Engine(kv_remote="http://localhost:6379")


def test_the_stores_own_budget_evicts_pages_and_evicted_pages_are_misses(
    make_engine: Any, loaded_fp32: Any, tmp_path: Path
) -> None:
    """Redis over ``maxmemory`` drops its least recently used pages (allkeys-lru): the writer
    never fails, a page gone is a miss, and the answers stay those of no cache."""
    documents = [
        f"Report {d}: " + " ".join(f"item {d}-{i} weighs {i * 3 + d} grams." for i in range(40))
        for d in range(4)
    ]
    prompts = [f"{doc}\nWhich item is heaviest?" for doc in documents]
    with Engine(model=loaded_fp32, num_pages=256, prefix_cache=False) as plain:
        want = [out.token_ids for out in plain.generate(prompts, greedy(NEW))]
    with redis_server(tmp_path, maxmemory="6mb") as (url, _):
        first = make_engine(num_pages=128, kv_remote=url)
        for prompt, tokens in zip(prompts, want):  # ~20 pages of ~0.7 MB each per document
            assert first.generate([prompt], greedy(NEW))[0].token_ids == tokens
            assert first._loop._kv.tiers.remote.flush()
        remote = first._loop._kv.tiers.remote
        assert remote.errors == 0 and remote.dropped == 0 and remote.written >= 60
        info = RedisClient(url)._redis.info()
        assert info["evicted_keys"] > 0 and info["used_memory"] <= 7 << 20, info
        second = make_engine(num_pages=128, kv_remote=url)
        outs = second.generate(prompts, greedy(NEW))
        assert [o.token_ids for o in outs] == want
        stats = second.stats()
        assert stats.tiers.remote_errors == 0
        # ~8 pages fit: the oldest document cannot have survived whole
        assert outs[0].cached_tokens < outs[0].prompt_tokens - 16, outs[0]
        assert_idle_accounting(second)


def test_a_server_killed_mid_run_costs_misses_and_is_used_again_once_back(
    make_engine: Any, reference: list[list[int]], tmp_path: Path
) -> None:
    with redis_server(tmp_path) as (url, proc):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        eng = make_engine(num_pages=64, kv_remote=url)
        remote = eng._loop._kv.tiers.remote
        assert eng.generate(PROMPTS[:1], greedy(NEW))[0].token_ids == reference[0]
        assert remote.flush() and remote.written > 0
        proc.kill()
        proc.wait()
        outs = eng.generate(PROMPTS[1:], greedy(NEW))  # pool hits; writes and lookups fail
        assert [o.token_ids for o in outs] == reference[1:]
        assert eng.stats().tiers.remote_errors >= 1
    with redis_server(tmp_path, port=port) as (url, _):  # back, empty
        time.sleep(RETRY_AFTER_S + 0.2)
        written = remote.written
        eng.generate([" ".join(f"Line {i} of a new memo." for i in range(20))], greedy(NEW))
        assert remote.flush() and remote.written > written  # writes resumed
        assert_idle_accounting(eng)
