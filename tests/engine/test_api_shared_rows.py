"""Identical requests in flight together compute their rows once
(``scheduler/shared_rows.py``): the runner copies the leader's K/V into the follower's slots
and gives it the leader's tokens. Pinned on the real model: every answer is the answer the
request gets alone (greedy with different lengths, seeded with one seed, with and without
speculation, cache on and off), a follower whose leader ends or is aborted goes on alone from
the copied K/V, followers keep their answers through preemption, nothing is shared where sampling is not a function of the tokens
or across namespaces, and every page is accounted for at idle."""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import CHAT_PROMPTS, assert_idle_accounting, greedy, user

from engine import Engine, SamplingParams

QUESTION = user(CHAT_PROMPTS[2])
OTHER = user(CHAT_PROMPTS[1])


def shared_rows(eng: Engine) -> int:
    return eng.stats().counters.shared_rows


@pytest.mark.parametrize(("speculation", "prefix_cache"),
                         [("off", True), ("tree", True), ("off", False)])
def test_identical_requests_in_flight_answer_as_they_do_alone(
    engine: Engine, make_engine: Any, speculation: str, prefix_cache: bool
) -> None:
    seeded = SamplingParams(max_new_tokens=24, temperature=0.8, seed=7)
    # Three identical greedy requests that end at different lengths (the longer go on alone
    # from the K/V copied into them), two identical seeded ones, and two unseeded samples
    # (never sharing).
    prompts = [QUESTION, QUESTION, QUESTION, OTHER, OTHER, QUESTION, QUESTION]
    params = [greedy(8), greedy(32), greedy(32), seeded, seeded,
              SamplingParams(max_new_tokens=16, temperature=0.8),
              SamplingParams(max_new_tokens=16, temperature=0.8)]
    alone = [engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    eng = make_engine(page_size=16, num_pages=256, speculation=speculation,
                      prefix_cache=prefix_cache)
    together = eng.generate(prompts, params)
    for i in range(5):
        assert together[i].token_ids == alone[i].token_ids, f"request {i}"
        assert together[i].text == alone[i].text
    # Every row after a request's first token is its leader's (those that waited for the
    # first's prefill to hit its prefix catch up by copying): two followers of the first while
    # it runs, then one of the second; one seeded follower.
    n = [len(o.token_ids) for o in alone]
    assert shared_rows(eng) >= 2 * (n[0] - 1) + (n[1] - n[0]) + (n[3] - 1)
    assert_idle_accounting(eng)


def test_a_follower_goes_on_alone_when_its_leader_is_aborted(
    engine: Engine, make_engine: Any
) -> None:
    params = greedy(48)
    expected = engine.generate([QUESTION], params)[0].token_ids
    # Without a prefix cache nothing waits for another's prefill: both run in lockstep.
    eng = make_engine(page_size=16, num_pages=256, prefix_cache=False)
    leader = eng.submit(QUESTION, params, stream=True)
    follower = eng.submit(QUESTION, params)
    for n, _ in enumerate(leader):  # the leader's first text deltas: both are decoding
        if n == 4:
            break
    leader.abort()
    assert follower.result().token_ids == expected
    assert shared_rows(eng) > 0
    assert_idle_accounting(eng)


def test_a_follower_catching_up_past_its_own_limit_keeps_its_own_text(
    engine: Engine, make_engine: Any
) -> None:
    """A follower that arrives while its leader is well ahead catches up in one step with the
    leader's tokens: those past its own max_new_tokens were cut from its token_ids but had
    reached its text, its stream and its inter-token gaps (', the city of Nova Haven was a
    thriving metropolis, with' for ', the city of Nova')."""
    short = greedy(5, ignore_eos=True)
    [alone] = engine.generate([QUESTION], short)
    eng = make_engine(page_size=16, num_pages=256)
    leader = eng.submit(QUESTION, greedy(60, ignore_eos=True), stream=True)
    ahead = iter(leader)  # kept: a dropped iterator aborts its request
    for _ in range(12):  # the leader is 12 text deltas ahead
        next(ahead)
    before = shared_rows(eng)
    items = list(eng.submit(QUESTION, short, stream=True))
    leader.abort()
    *deltas, follower = items
    assert shared_rows(eng) - before > len(alone.token_ids)  # it did catch up by copying
    assert follower.token_ids == alone.token_ids and follower.text == alone.text
    assert "".join(deltas) == alone.text and len(follower.itl_s) == len(follower.token_ids) - 1
    assert_idle_accounting(eng)


def test_rows_are_not_shared_across_namespaces_or_where_results_are_per_request(
    make_engine: Any,
) -> None:
    eng = make_engine(page_size=16, num_pages=256)
    eng.generate([QUESTION, QUESTION], SamplingParams(max_new_tokens=12, temperature=0.8))
    eng.generate([QUESTION, QUESTION], greedy(12, logprobs=2))
    for namespace in ("a", "b"):  # one request in each: identical, but apart
        eng.submit(QUESTION, greedy(12), namespace=namespace)
    assert eng.wait_idle(timeout=60)
    assert shared_rows(eng) == 0
    off = make_engine(page_size=16, num_pages=256, share_rows=False)
    off.generate([QUESTION, QUESTION], greedy(12))
    assert shared_rows(off) == 0
    assert_idle_accounting(eng)


def test_rows_are_not_shared_where_passes_are_not_batch_invariant(make_engine: Any) -> None:
    eng = make_engine(page_size=16, num_pages=256, batch_invariant=False)
    eng.generate([QUESTION, QUESTION], greedy(12))
    assert shared_rows(eng) == 0


def test_followers_keep_their_answers_through_preemption(engine: Engine, make_engine: Any) -> None:
    # 56 pages of 4 tokens, no decode reserve: the scheduler over-admits and preempts.
    prompts = [QUESTION, OTHER, QUESTION, OTHER]
    params = greedy(64, ignore_eos=True)  # every answer its full length: the pages run out
    plain = [engine.generate([p], params)[0].token_ids for p in prompts]
    eng = make_engine(page_size=4, num_pages=56, max_batch_tokens=48, max_running=8,
                      reserve_ratio_init=0.0, reserve_ratio_min=0.0, reserve_margin=0.0)
    assert [o.token_ids for o in eng.generate(prompts, params)] == plain
    c = eng.stats().counters
    assert c.preemptions > 0 and c.shared_rows > 0
    assert_idle_accounting(eng)
