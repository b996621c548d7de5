"""The cascade rule: attend a shared prefix once only where the estimate says it wins by the
margin, after the kernels it adds; and the FlashInfer plan follows it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.cuda.cascade_rule import CascadeCosts, SharedRun, cascade_pays
from engine.model.cuda.flashinfer_plan import plan_flashinfer
from engine.model.forward_batch import ForwardBatch
from scheduler import SamplingParams
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request

# The 1B Llama shape: 8 KV heads of 64, groups of 4, bf16: 2 KiB of K and V per token a layer
LLAMA_1B = {"kv_heads": 8, "group": 4, "bytes_per_token": 2 * 8 * 64 * 2}


def test_few_requests_on_a_short_prefix_stay_on_their_own_pages() -> None:
    # the H200 run's case: 8 decodes on 1,000 shared tokens lost with the cascade
    assert not cascade_pays([SharedRun(8, 1000, 8)], 1, **LLAMA_1B)
    assert not cascade_pays([SharedRun(32, 1024, 32)], 1, **LLAMA_1B)


def test_many_requests_on_a_long_prefix_are_cascaded() -> None:
    assert cascade_pays([SharedRun(64, 4096, 64)], 1, **LLAMA_1B)


def test_no_shared_run_is_no_cascade() -> None:
    assert not cascade_pays([], 0, **LLAMA_1B)


def test_dearer_launches_or_a_larger_margin_only_ever_turn_the_cascade_off() -> None:
    run = [SharedRun(64, 4096, 64)]
    assert not cascade_pays(run, 1, **LLAMA_1B, costs=CascadeCosts(launch_seconds=1e-3))
    assert not cascade_pays(run, 1, **LLAMA_1B, costs=CascadeCosts(margin=100.0))


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 256), st.integers(16, 16384), st.integers(1, 4))
def test_more_members_or_more_shared_tokens_never_turn_a_paying_cascade_off(
    members: int, tokens: int, levels: int
) -> None:
    if cascade_pays([SharedRun(members, tokens, members)], levels, **LLAMA_1B):
        assert cascade_pays([SharedRun(2 * members, tokens, 2 * members)], levels, **LLAMA_1B)
        assert cascade_pays([SharedRun(members, 2 * tokens, members)], levels, **LLAMA_1B)


def _shared_decodes(members: int, shared_pages: int, ps: int = 16) -> ForwardBatch:
    entries = []
    for i in range(members):
        pages = list(range(shared_pages)) + [shared_pages + i]
        kv = shared_pages * ps + 1
        req = Request(i, [7] * (kv - 1), SamplingParams(max_new_tokens=2), output=[7])
        entries.append(BatchEntry.on_pages(req, [7], kv - 1, pages, ps))
    return ForwardBatch.from_batch(Batch(entries, ps))


def test_the_plan_cascades_only_where_the_rule_says_it_pays() -> None:
    fb = _shared_decodes(4, 8)
    assert plan_flashinfer(fb, True, 1).shared is not None  # no rule: every saving
    assert plan_flashinfer(fb, True, 1, lambda runs, levels: False).shared is None
    seen: list[tuple[list[SharedRun], int]] = []

    def record(runs: list[SharedRun], levels: int) -> bool:
        seen.append((runs, levels))
        return True

    assert plan_flashinfer(fb, True, 1, record).shared is not None
    assert seen == [([SharedRun(4, 8 * 16, 4)], 1)]
