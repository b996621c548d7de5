"""The cache-only simulator drives the real scheduler through closed-loop synthetic traces."""

from __future__ import annotations

from workloads.simulators.one_engine import simulate
from workloads.simulators.script import expand
from workloads.simulators.stats import pool_pages, trace_stats
from workloads.traces.synthetic import multi_turn_chat, shared_prefix


def test_closed_loop_turns_carry_the_previous_reply_and_every_policy_sees_the_same_prompts() -> None:
    trace = multi_turn_chat(conversations=4, turns=3, system=40, user=20, reply=10)
    requests = expand(trace)
    by_turn = {(s, t): (prompt, answer) for s, t, prompt, answer in requests}
    prompt0, answer0 = by_turn[(0, 0)]
    prompt1, _ = by_turn[(0, 1)]
    assert prompt1[: len(prompt0) + len(answer0)] == prompt0 + answer0
    stats = trace_stats(trace, 4)
    results = [simulate(trace, policy, 10_000, 4, stats) for policy in ("fcfs", "lpm")]
    for result in results:
        assert result.requests == 12
        assert result.prompt_tokens == sum(len(p) for _, _, p, _ in requests)
        assert result.decode_tokens == 12 * 9  # the first reply token comes from prefill
    # With room for everything, every turn after the first hits its whole history.
    assert results[1].hit_rate > 0.6


def test_lpm_reaches_the_ideal_hit_rate_on_shared_prefixes_with_a_quarter_of_the_cache() -> None:
    trace = shared_prefix(groups=4, per_group=6, prefix=256, unique=20, reply=8)
    stats = trace_stats(trace, 16)
    result = simulate(trace, "lpm", pool_pages(stats, 0.25), 16, stats, max_batch_tokens=512)
    assert result.hit_rate >= 0.95 * stats.ideal_hit_rate
    fcfs = simulate(trace, "fcfs", pool_pages(stats, 0.25), 16, stats, max_batch_tokens=512)
    assert fcfs.computed_prefill_tokens >= result.computed_prefill_tokens
