"""Scheduler behaviours pinned down one by one, with the scripted model (no torch)."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import (
    STOP,
    ScriptedModel,
    assert_output_follows_script,
    make_scheduler,
    run_to_idle,
)

from radix import KVManager
from scheduler import Batch, Request, RequestState, SamplingParams, Scheduler, SchedulerConfig

POLICIES = ["fcfs", "lpm", "dfs-weight"]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 50_000) for _ in range(n)]


def step(sched: Scheduler, model: ScriptedModel) -> tuple[Batch, list[Request]]:
    batch = sched.schedule()
    assert batch is not None
    finished = sched.commit(batch, model.step(batch))
    sched.check_integrity()
    return batch, finished


# ---------------------------------------------------------------------- grouping


@pytest.mark.parametrize("policy", POLICIES)
def test_requests_arriving_together_compute_their_shared_prefix_once(policy: str) -> None:
    rng = random.Random(1)
    prefix = random_tokens(rng, 1000)
    suffix = 40
    sched, model, _, _ = make_scheduler(
        400, 16, max_batch_tokens=2048, max_running=16, policy=policy
    )
    requests = [
        Request(id=i, prompt=prefix + random_tokens(rng, suffix), params=SamplingParams(max_new_tokens=4))
        for i in range(8)
    ]
    for request in requests:
        sched.add(request)
    run_to_idle(sched, model)
    computed = sched.counters.computed_prefill_tokens
    # The prefix once; each follower computes its suffix plus the prefix's unaligned tail.
    assert computed <= 1000 + 8 * (suffix + 16), computed
    assert all(r.cached_tokens >= 992 for r in requests[1:])
    assert sched.counters.grouped_deferrals > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_without_grouping_the_same_requests_compute_the_prefix_several_times(
    policy: str,
) -> None:
    # The control for the test above: proves the grouping, not luck, saves the work.
    rng = random.Random(1)
    prefix = random_tokens(rng, 1000)
    sched, model, _, _ = make_scheduler(
        400, 16, max_batch_tokens=2048, max_running=16, policy=policy, group_min_tokens=10_000
    )
    for i in range(8):
        sched.add(Request(id=i, prompt=prefix + random_tokens(rng, 40), params=SamplingParams(max_new_tokens=4)))
    run_to_idle(sched, model)
    assert sched.counters.computed_prefill_tokens > 1500


# ---------------------------------------------------------------------- policies


def interleaved_groups(
    groups: int = 8, per_group: int = 16, prefix: int = 256, suffix: int = 32
) -> list[list[int]]:
    rng = random.Random(0)
    prefixes = [random_tokens(rng, prefix) for _ in range(groups)]
    return [
        prefixes[g] + random_tokens(rng, suffix) for _ in range(per_group) for g in range(groups)
    ]


def hit_rate(policy: str, prompts: list[list[int]], num_pages: int) -> float:
    sched, model, _, _ = make_scheduler(
        num_pages, 16, max_batch_tokens=512, max_running=8, policy=policy
    )
    for i, prompt in enumerate(prompts):
        sched.add(Request(id=i, prompt=prompt, params=SamplingParams(max_new_tokens=8)))
    run_to_idle(sched, model, check=False)
    sched.check_integrity()
    return sched.counters.hit_rate


def test_lpm_beats_fcfs_and_dfs_weight_matches_lpm_when_the_cache_holds_a_quarter() -> None:
    prompts = interleaved_groups()
    working_set_pages = (8 * 256 + 8 * 16 * 32) // 16
    num_pages = working_set_pages // 4
    fcfs = hit_rate("fcfs", prompts, num_pages)
    lpm = hit_rate("lpm", prompts, num_pages)
    dfs = hit_rate("dfs-weight", prompts, num_pages)
    assert lpm > fcfs + 0.3, (lpm, fcfs)
    assert dfs >= lpm - 1e-9, (dfs, lpm)


def test_lpm_picks_the_longest_cached_prefix_among_thousands_waiting() -> None:
    rng = random.Random(2)
    sched, model, _, _ = make_scheduler(
        2000, 16, max_batch_tokens=256, max_running=1, policy="lpm"
    )
    warm = random_tokens(rng, 200)
    sched.add(Request(id="warm", prompt=warm + [7], params=SamplingParams(max_new_tokens=1)))
    run_to_idle(sched, model)
    for i in range(3000):
        sched.add(Request(id=i, prompt=random_tokens(rng, 64), params=SamplingParams(max_new_tokens=1)))
    # Arrives last, but shares 192 cached tokens: it must run first.
    sched.add(Request(id="last", prompt=warm + random_tokens(rng, 10), params=SamplingParams(max_new_tokens=1)))
    batch, _ = step(sched, model)
    assert [e.request.id for e in batch.entries] == ["last"]
    assert batch.entries[0].start_pos == 192


def test_lpm_does_not_rematch_every_waiting_request_every_step() -> None:
    rng = random.Random(3)
    sched, model, _, _ = make_scheduler(
        4000, 16, max_batch_tokens=128, max_running=4, policy="lpm"
    )
    shared = [random_tokens(rng, 64) for _ in range(20)]
    for i in range(2000):
        sched.add(Request(id=i, prompt=shared[i % 20] + random_tokens(rng, 32), params=SamplingParams(max_new_tokens=2)))
    before = sched._matches.rematches
    steps = 0
    for _ in range(50):
        step(sched, model)
        steps += 1
    rematches = sched._matches.rematches - before
    # Re-matching the queue every step would cost ~2,000 matches per step.
    assert rematches < 20 * steps, rematches


# ---------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_never_makes_a_sharing_request_read_a_freed_page() -> None:
    rng = random.Random(4)
    max_batch_tokens = 64
    long_prompt = random_tokens(rng, 5 * max_batch_tokens)
    sched, model, _, allocator = make_scheduler(
        200, 4, max_batch_tokens=max_batch_tokens, max_running=4
    )
    first = Request(id="long", prompt=long_prompt, params=SamplingParams(max_new_tokens=3))
    second = Request(id="shares", prompt=long_prompt[:300] + [11, 12, 13], params=SamplingParams(max_new_tokens=3))
    sched.add(first)
    seen_second = False

    def check_batch(batch: Batch) -> None:
        nonlocal seen_second
        assert batch.num_tokens <= max_batch_tokens
        for entry in batch.entries:
            for page in entry.pages:
                assert not allocator.is_free(page)
            seen_second |= entry.request is second

    batch, _ = step(sched, model)  # the first chunk runs alone
    check_batch(batch)
    sched.add(second)
    run_to_idle(sched, model, on_batch=check_batch)
    assert seen_second
    assert model.pages_read > 0
    assert second.cached_tokens == 300  # it waited for the long prefill and hit all of it
    assert first.state is second.state is RequestState.FINISHED


def test_decodes_and_prefill_chunks_share_a_step_within_the_budget() -> None:
    rng = random.Random(5)
    sched, model, _, _ = make_scheduler(200, 4, max_batch_tokens=32, max_running=8)
    sched.add(Request(id="a", prompt=random_tokens(rng, 10), params=SamplingParams(max_new_tokens=20)))
    step(sched, model)
    sched.add(Request(id="b", prompt=random_tokens(rng, 100), params=SamplingParams(max_new_tokens=2)))
    batch, _ = step(sched, model)
    kinds = {e.request.id: e.is_decode for e in batch.entries}
    assert kinds == {"a": True, "b": False}
    assert batch.num_tokens == 32
    assert [e.sample for e in batch.entries] == [True, False]


# ---------------------------------------------------------------------- abort


def abort_and_check(sched: Scheduler, request: Request) -> None:
    assert sched.abort(request.id) is request
    assert request.state is RequestState.ABORTED and request.finish_reason == "abort"
    assert request.kv is None
    assert sched.abort(request.id) is None
    sched.check_integrity()


def test_abort_of_a_waiting_request_frees_nothing_and_drops_it() -> None:
    sched, model, _, _ = make_scheduler(40, 4, max_batch_tokens=8, max_running=1)
    a = Request(id="a", prompt=list(range(10, 30)), params=SamplingParams(max_new_tokens=2))
    b = Request(id="b", prompt=list(range(10, 30)), params=SamplingParams(max_new_tokens=2))
    sched.add(a)
    sched.add(b)
    step(sched, model)
    abort_and_check(sched, b)
    run_to_idle(sched, model)
    assert a.state is RequestState.FINISHED and not b.output


def test_abort_mid_prefill_and_mid_decode_frees_everything() -> None:
    sched, model, cache, allocator = make_scheduler(40, 4, max_batch_tokens=8, max_running=2)
    prefilling = Request(id="p", prompt=list(range(100, 130)), params=SamplingParams(max_new_tokens=4))
    decoding = Request(id="d", prompt=list(range(10, 16)), params=SamplingParams(max_new_tokens=30))
    sched.add(decoding)
    step(sched, model)
    sched.add(prefilling)
    step(sched, model)
    assert prefilling.is_prefilling and prefilling.num_computed > 0
    assert decoding.output and not decoding.is_prefilling
    abort_and_check(sched, prefilling)
    abort_and_check(sched, decoding)
    assert not sched.has_work
    assert allocator.num_free + cache.cached_pages == allocator.num_pages
    assert cache.protected_pages == 0


def test_abort_between_schedule_and_commit_skips_the_entry() -> None:
    sched, model, _, _ = make_scheduler(40, 4, max_batch_tokens=16, max_running=2)
    request = Request(id="x", prompt=list(range(10, 20)), params=SamplingParams(max_new_tokens=4))
    sched.add(request)
    batch = sched.schedule()
    assert batch is not None
    tokens = model.step(batch)
    abort_and_check(sched, request)
    assert sched.commit(batch, tokens) == []
    assert not request.output
    sched.check_integrity()


def test_abort_of_a_preempted_request_and_of_a_finished_one() -> None:
    sched, model, _, _ = make_scheduler(
        10, 4, max_batch_tokens=16, max_running=2, reserve_ratio_init=0.0,
        reserve_ratio_min=0.0, reserve_margin=0.0,
    )
    old = Request(id="old", prompt=list(range(10, 18)), params=SamplingParams(max_new_tokens=24))
    new = Request(id="new", prompt=list(range(50, 58)), params=SamplingParams(max_new_tokens=24))
    sched.add(old)
    sched.add(new)
    for _ in range(30):
        step(sched, model)
        if new.num_preemptions:
            break
    assert new.num_preemptions == 1 and new.state is RequestState.WAITING and new.output
    abort_and_check(sched, new)
    run_to_idle(sched, model)
    assert old.state is RequestState.FINISHED
    assert sched.abort(old.id) is None


# ---------------------------------------------------------------------- preemption


def test_a_preempted_request_resumes_with_a_hit_and_continues_its_output() -> None:
    sched, model, _, _ = make_scheduler(
        14, 4, max_batch_tokens=32, max_running=2, reserve_ratio_init=0.0,
        reserve_ratio_min=0.0, reserve_margin=0.0,
    )
    old = Request(id="old", prompt=list(range(10, 22)), params=SamplingParams(max_new_tokens=20))
    new = Request(id="new", prompt=list(range(50, 62)), params=SamplingParams(max_new_tokens=20))
    sched.add(old)
    sched.add(new)
    resumed_at: list[int] = []

    def watch(batch: Batch) -> None:
        for entry in batch.entries:
            if entry.request is new and new.num_preemptions and not resumed_at:
                resumed_at.append(entry.start_pos)

    run_to_idle(sched, model, on_batch=watch)
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    assert sched.counters.preemptions >= 1
    assert resumed_at and resumed_at[0] >= 12  # its prompt (at least) came from the tree
    for request in (old, new):
        assert request.finish_reason == "length"
        assert_output_follows_script(model, request)


# ---------------------------------------------------------------------- finishing


def test_stop_token_finishes_and_keeps_the_token() -> None:
    sched, model, cache, _ = make_scheduler(40, 4, max_batch_tokens=16, max_running=2)
    request = Request(id="s", prompt=list(range(10, 20)), params=SamplingParams(max_new_tokens=10, stop_token_ids=[STOP]))
    model.stop_at["s"] = 3
    sched.add(request)
    run_to_idle(sched, model)
    assert request.finish_reason == "stop" and request.output[-1] == STOP
    assert len(request.output) == 4
    assert request.first_token_time is not None and request.finish_time is not None
    # Prompt + output with K/V went into the tree: all but the last sampled token.
    match = cache.match_prefix(request.prompt + request.output)
    assert match.length == ((len(request.prompt) + 3) // 4) * 4


def test_a_reported_stop_string_finishes_a_running_request_as_stopped() -> None:
    sched, model, cache, allocator = make_scheduler(40, 4, max_batch_tokens=16, max_running=2)
    request = Request(id="f", prompt=list(range(10, 20)), params=SamplingParams(max_new_tokens=10))
    sched.add(request)
    step(sched, model)
    batch = sched.schedule()
    assert batch is not None
    assert sched.commit(batch, model.step(batch), hit_stop_string={request}) == [request]
    assert request.state is RequestState.FINISHED and request.finish_reason == "stop"
    assert len(request.output) == 2
    assert not sched.has_work
    sched.check_integrity()
    assert allocator.num_free + cache.cached_pages == allocator.num_pages


def test_namespaces_never_share_cached_prefixes() -> None:
    sched, model, _, _ = make_scheduler(60, 4, max_batch_tokens=64, max_running=4)
    prompt = list(range(10, 50))
    a = Request(id="a", prompt=prompt, params=SamplingParams(max_new_tokens=1), namespace="tenant-a")
    sched.add(a)
    run_to_idle(sched, model)
    b = Request(id="b", prompt=prompt, params=SamplingParams(max_new_tokens=1), namespace="tenant-b")
    c = Request(id="c", prompt=prompt, params=SamplingParams(max_new_tokens=1), namespace="tenant-a")
    sched.add(b)
    sched.add(c)
    run_to_idle(sched, model)
    assert b.cached_tokens == 0 and c.cached_tokens == 36


def test_counters_only_grow() -> None:
    rng = random.Random(6)
    sched, model, _, _ = make_scheduler(30, 4, max_batch_tokens=16, max_running=3)
    previous = sched.counters
    for i in range(12):
        sched.add(Request(id=i, prompt=random_tokens(rng, rng.randrange(1, 30)), params=SamplingParams(max_new_tokens=5)))
    while sched.has_work:
        step(sched, model)
        now = sched.counters
        for name, value in vars(now).items():
            assert value >= getattr(previous, name), name
        previous = now


# ---------------------------------------------------------------------- errors


def test_bad_config_and_requests_raise_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="random")
    with pytest.raises(ValueError, match="max_batch_tokens"):
        SchedulerConfig(max_batch_tokens=0)
    with pytest.raises(ValueError, match="max_running"):
        SchedulerConfig(max_batch_tokens=8, max_running=16)
    with pytest.raises(ValueError, match="page_size"):
        Scheduler(KVManager(8, 4), SchedulerConfig(page_size=16))
    sched, _, _, _ = make_scheduler(8, 4, max_batch_tokens=16, max_running=2)
    with pytest.raises(ValueError, match="request.prompt"):
        sched.add(Request(id=1, prompt=[], params=SamplingParams(max_new_tokens=4)))
    with pytest.raises(ValueError, match="max_new_tokens"):
        sched.add(Request(id=2, prompt=[5], params=SamplingParams(max_new_tokens=0)))
    with pytest.raises(ValueError, match="pages"):
        sched.add(Request(id=3, prompt=list(range(10, 40)), params=SamplingParams(max_new_tokens=4)))
    sched.add(Request(id=4, prompt=[5, 6], params=SamplingParams(max_new_tokens=2)))
    with pytest.raises(ValueError, match="request.id"):
        sched.add(Request(id=4, prompt=[5, 6], params=SamplingParams(max_new_tokens=2)))


def test_schedule_twice_without_commit_is_refused_and_discard_recovers() -> None:
    sched, model, _, _ = make_scheduler(20, 4, max_batch_tokens=16, max_running=2)
    sched.add(Request(id=1, prompt=list(range(10, 30)), params=SamplingParams(max_new_tokens=2)))
    batch = sched.schedule()
    assert batch is not None
    with pytest.raises(RuntimeError, match="schedule"):
        sched.schedule()
    sched.discard(batch)
    sched.check_integrity()
    again = sched.schedule()
    assert again is not None and again.entries[0].pages == batch.entries[0].pages
    with pytest.raises(ValueError, match="batch"):
        sched.commit(batch, [0])
    with pytest.raises(ValueError, match="next_tokens"):
        sched.commit(again, [])
    sched.commit(again, model.step(again))
    run_to_idle(sched, model)


# ---------------------------------------------------------------------- cache off


def test_with_the_prefix_cache_off_nothing_is_reused_or_kept() -> None:
    rng = random.Random(7)
    prefix = random_tokens(rng, 200)
    sched, model, cache, allocator = make_scheduler(
        200, 16, max_batch_tokens=512, max_running=8, prefix_cache=False
    )
    requests = [
        Request(id=i, prompt=prefix + random_tokens(rng, 10), params=SamplingParams(max_new_tokens=3)) for i in range(4)
    ]
    sched.add(requests[0])
    run_to_idle(sched, model)
    for request in requests[1:]:
        sched.add(request)
    run_to_idle(sched, model)
    assert all(r.cached_tokens == 0 for r in requests)
    assert sched.counters.cached_tokens == 0
    assert sched.counters.computed_prefill_tokens == sum(len(r.prompt) for r in requests)
    assert sched.counters.grouped_deferrals == 0
    assert cache.cached_pages == 0
    assert allocator.num_free == allocator.num_pages
