"""generate() accepts every prompt kind, one params per prompt, and keeps input order."""

from __future__ import annotations

import numpy as np
from engine_helpers import greedy, user


def test_prompt_kinds_give_the_same_answer_in_input_order(engine, tokenizer) -> None:
    text = "The three primary colours are"
    ids = tokenizer.encode(text)
    messages = user("Name a primary colour.")
    outs = engine.generate([messages, ids, text, np.array(ids)], greedy(6))
    [alone_messages] = engine.generate(messages, greedy(6))
    [alone_text] = engine.generate(text, greedy(6))
    assert outs[0].token_ids == alone_messages.token_ids
    assert outs[1].token_ids == outs[2].token_ids == outs[3].token_ids == alone_text.token_ids
    assert outs[1].prompt_tokens == len(ids)


def test_one_params_per_prompt(engine) -> None:
    outs = engine.generate(
        ["Alpha beta gamma", "One two three"],
        [greedy(2, ignore_eos=True), greedy(5, ignore_eos=True)],
    )
    assert [len(o.token_ids) for o in outs] == [2, 5]
    assert [o.finish_reason for o in outs] == ["length", "length"]


def test_a_batch_of_chat_conversations(engine) -> None:
    convs = [user("Say one."), user("Say two.")]
    outs = engine.generate(convs, greedy(4))
    assert len(outs) == 2
    assert outs[0].token_ids == engine.generate(convs[0], greedy(4))[0].token_ids


def test_fresh_engine_is_idle(make_engine) -> None:
    eng = make_engine(page_size=16, num_pages=8)
    assert eng.wait_idle(timeout=5)
    stats = eng.stats()
    assert (stats.counters.requests, stats.pages.free, stats.pages.total) == (0, 8, 8)
