"""Log-probabilities: the model's own distribution, one entry per generated token, equal to
transformers' log-softmax, and independent of the cache and the batch like the tokens."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import CHAT_PROMPTS, greedy, user

from engine import SamplingParams

NEW_TOKENS = 8


def test_logprobs_equal_transformers_log_softmax(engine, chat_ids, hf_model) -> None:
    [out] = engine.generate(user(CHAT_PROMPTS[0]), greedy(NEW_TOKENS, logprobs=5))
    ids = chat_ids[0] + out.token_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    reference = logits.log_softmax(-1)[len(chat_ids[0]) - 1 : len(ids) - 1]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for row, entry, token in zip(reference, out.logprobs, out.token_ids):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(5).indices.tolist()
        assert entry.top[0][0] == token  # greedy picks the best
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


def test_logprobs_do_not_depend_on_cache_or_batch(make_engine) -> None:
    eng = make_engine(page_size=16, num_pages=128)
    prompts = [user(p) for p in CHAT_PROMPTS[:3]]
    alone = eng.generate(prompts[0], greedy(NEW_TOKENS, logprobs=2))[0]
    batched = eng.generate(prompts, greedy(NEW_TOKENS, logprobs=2))[0]  # now a cache hit
    assert batched.cached_tokens > 0
    assert batched.logprobs == alone.logprobs


def test_no_logprobs_unless_asked_and_zero_means_the_token_alone(engine) -> None:
    plain, zero = engine.generate([user(CHAT_PROMPTS[1])] * 2, [greedy(4), greedy(4, logprobs=0)])
    assert plain.logprobs is None
    assert zero.logprobs is not None and all(e.top == [] for e in zero.logprobs)
    assert len(zero.itl_s) == len(zero.token_ids) - 1 and zero.queue_s is not None


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True, "3"])
def test_logprobs_out_of_range_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_streamed_deltas_carry_their_tokens_and_logprobs(engine) -> None:
    import asyncio

    from engine.api import Delta

    async def run():
        handle = engine.submit(user(CHAT_PROMPTS[2]), greedy(10, logprobs=1), stream=True)
        return [item async for item in handle.events()]

    items = asyncio.run(run())
    deltas, final = items[:-1], items[-1]
    assert all(isinstance(d, Delta) for d in deltas)
    sent = [t for d in deltas for t in d.token_ids]
    assert sent == final.token_ids[: len(sent)]
    assert [lp for d in deltas for lp in d.logprobs] == final.logprobs[: len(sent)]
    assert "".join(d.text for d in deltas) == final.text


def test_prompt_logprobs_are_those_of_the_same_tokens_generated(
    make_engine, chat_ids, hf_model
) -> None:
    """A prompt scored in chunks (16 tokens a pass), batched with other requests and after
    its prefix was cached, gets for its tokens exactly the entries that generating them gave
    (same floats, alternatives and ranks), and transformers' log-softmax."""
    eng = make_engine(page_size=16, num_pages=256, max_batch_tokens=16, max_running=8)
    prompt = chat_ids[0]
    [made] = eng.generate([prompt], greedy(NEW_TOKENS, logprobs=3))
    full = prompt + made.token_ids
    others = [user(p) for p in CHAT_PROMPTS[1:3]]
    scored, *_ = eng.generate(
        [full, *others], [greedy(2, prompt_logprobs=3), greedy(6), greedy(6)]
    )
    assert scored.cached_tokens == 0  # a cached page has K/V, not the logits it needs
    scores = scored.prompt_logprobs
    assert scores is not None and len(scores) == len(full) and scores[0] is None
    assert [e.token_id for e in scores[1:]] == full[1:]
    assert scores[len(prompt):] == made.logprobs
    with torch.inference_mode():
        logits = hf_model(torch.tensor([full])).logits[0].float()
    reference = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(full[1:]).view(-1, 1))
    assert [e.logprob for e in scores[1:]] == pytest.approx(reference.view(-1).tolist(), abs=1e-4)
    assert scored.logprobs is None  # prompt_logprobs alone scores no generated token
    eng.wait_idle()
    pages = eng.stats().pages
    assert pages.free + pages.cached == pages.total


def test_prompt_logprobs_only_when_asked_and_rank_counts_better_tokens(engine) -> None:
    plain, one, scored = engine.generate(
        [[1, 2, 3, 4], [7], [1, 2, 3, 4]],
        [greedy(1), greedy(1, prompt_logprobs=0), greedy(1, prompt_logprobs=2)],
    )
    assert plain.prompt_logprobs is None
    assert one.prompt_logprobs == [None]  # nothing predicts a prompt's first token
    ranks = []
    for entry in scored.prompt_logprobs[1:]:
        better = sum(lp > entry.logprob for _, lp in entry.top)  # of the 2 best
        ranks.append(entry.rank)
        if entry.rank <= 2:
            assert entry.rank == better + 1
        else:
            assert better == 2
    assert max(ranks) > 2  # [1, 2, 3, 4] is no likely text


def test_prompt_logprobs_come_with_a_streams_first_delta(engine) -> None:
    import asyncio

    async def run():
        handle = engine.submit("Tell me a story", greedy(6, prompt_logprobs=1), stream=True)
        return [item async for item in handle.events()]

    *deltas, final = asyncio.run(run())
    assert deltas and deltas[0].prompt_logprobs is not None
    assert list(deltas[0].prompt_logprobs) == final.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs: must be None or an integer in"):
        SamplingParams(prompt_logprobs=bad)
