"""Engine.inspect: the tree and the last admissions as the loop saw them, taken between
passes; a bad budget is refused and a closed engine says so."""

from __future__ import annotations

from typing import Any

import pytest

from engine import Engine, SamplingParams
from engine.api import EngineDeadError

SYSTEM = "You are the engine inspection test. Answer briefly and politely, always. " * 3


def test_inspect_shows_the_shared_prefix_and_names_each_admissions_misses(
    loaded_fp32: Any,
) -> None:
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    with Engine(model=loaded_fp32, num_pages=128) as engine:
        engine.generate([SYSTEM + "Question one?"], greedy)
        engine.generate([SYSTEM + "Question two?"], greedy)
        engine.generate([SYSTEM + "Question one?"], greedy, namespace="other")
        snapshot = engine.inspect(budget=50)
        assert snapshot.loop_s >= 0 and snapshot.tree.total_nodes == len(snapshot.tree.nodes)
        assert [ns.name for ns in snapshot.tree.namespaces] == [None, "other"]
        first, second, other = snapshot.requests
        assert (first.reason, first.cached_tokens) == ("never_seen", 0)
        # the system prompt's whole pages were cached; the question sits in the last page
        assert second.cached_tokens > 0 and second.missed_tokens == 0
        assert second.reason == "page_boundary"
        assert second.cached_tokens + second.boundary_tokens == second.prompt_tokens
        assert (other.reason, other.namespace) == ("other_namespace", "other")
        assert snapshot.stats.counters.requests == 3
        assert not any(node.in_flight for node in snapshot.tree.nodes)  # idle
        with pytest.raises(ValueError, match="budget"):
            engine.inspect(budget=-1)
    with pytest.raises(EngineDeadError):
        engine.inspect()
