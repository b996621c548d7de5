"""The benchmark's replay: full capacity reaches the ideal hit rate, and under pressure the
tree's partial-leaf eviction keeps at least the hit rate of a per-page LRU."""

from __future__ import annotations

import pytest

from workloads.traces.synthetic import multi_turn_chat, rag, shared_prefix
from workloads.tree_bench.replay import per_page_lru_hit_rate, replay, unique_pages
from workloads.tree_bench.requests import replay_requests


def _small_traces() -> dict[str, list]:
    return {
        "shared-prefix": replay_requests(shared_prefix(groups=4, per_group=6, replies=True)),
        "multi-turn": replay_requests(multi_turn_chat(conversations=6, turns=4, replies=True)),
        "rag": replay_requests(rag(documents=20, requests=60, replies=True)),
    }


@pytest.mark.parametrize("page_size", [1, 16])
def test_full_capacity_hit_rate_equals_the_infinite_cache(page_size: int) -> None:
    for trace in _small_traces().values():
        total = unique_pages(trace, page_size)
        infinite = replay(trace, page_size, 10 * total).hit_rate
        assert replay(trace, page_size, total).hit_rate == infinite
        assert infinite > 0.5


@pytest.mark.parametrize("page_size", [1, 16])
def test_under_pressure_the_tree_hits_at_least_as_often_as_a_per_page_lru(page_size: int) -> None:
    for trace in _small_traces().values():
        largest = max((len(r.prompt) + len(r.reply)) // page_size for r in trace)
        capacity = max(unique_pages(trace, page_size) // 10, largest)
        tree = replay(trace, page_size, capacity).hit_rate
        assert tree >= per_page_lru_hit_rate(trace, page_size, capacity)
