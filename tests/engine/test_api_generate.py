"""generate() accepts every prompt kind, one params per prompt, and keeps input order."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from engine_helpers import greedy, user

from engine import StructuredOutputsParams


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


def test_min_tokens_holds_back_eos_and_stop_strings_until_reached(engine) -> None:
    """vLLM's min_tokens: EOS and stop ids are masked, and stop strings not looked for,
    until that many tokens came; the tokens before are those without it."""
    prompt = [{"role": "user", "content": "Say hi."}]
    [free] = engine.generate(prompt, greedy(64))
    assert free.finish_reason == "stop"
    k = len(free.token_ids)  # the last one is EOS
    [held] = engine.generate(prompt, greedy(64, min_tokens=k + 6))
    assert len(held.token_ids) >= k + 6
    assert held.token_ids[: k - 1] == free.token_ids[: k - 1]
    assert free.token_ids[-1] not in held.token_ids[: k + 6]
    [cut] = engine.generate("1, 2, 3, 4, 5,", greedy(16, stop=[","]))
    [later] = engine.generate("1, 2, 3, 4, 5,", greedy(16, stop=[","], min_tokens=6))
    assert "," not in cut.text and "," in later.text
    assert later.finish_reason == "stop" and later.text.startswith(cut.text)
    assert len(later.token_ids) > 6
    with pytest.raises(ValueError, match=r"min_tokens: must be an integer in \[0, max_new"):
        greedy(4, min_tokens=5)
    with pytest.raises(ValueError, match=r"min_tokens: not supported with structured outputs"):
        greedy(8, min_tokens=2, structured_outputs=StructuredOutputsParams(json_object=True))


def test_include_stop_str_in_output_keeps_the_stop_string(engine) -> None:
    [cut] = engine.generate("1, 2, 3, 4, 5,", greedy(16, stop=[" 8"]))
    [kept] = engine.generate(
        "1, 2, 3, 4, 5,", greedy(16, stop=[" 8"], include_stop_str_in_output=True)
    )
    assert kept.finish_reason == cut.finish_reason == "stop"
    assert kept.text == cut.text + " 8" and kept.token_ids == cut.token_ids


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(engine) -> None:
    ids = engine.encode("One, two, three, four, five, six, seven, eight, nine, ten,")
    [kept] = engine.generate([ids], greedy(6, truncate_prompt_tokens=8))
    [tail] = engine.generate([list(ids[-8:])], greedy(6))
    assert kept.prompt_tokens == 8 and kept.token_ids == tail.token_ids
    [whole] = engine.generate([ids], greedy(6, truncate_prompt_tokens=-1))
    assert whole.prompt_tokens == len(ids)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens: must be None, an integer"):
        greedy(6, truncate_prompt_tokens=0)


def test_special_tokens_reach_the_text_only_when_asked(engine) -> None:
    """A reply that ends on <|im_end|> with ignore_eos goes on past it: the text shows it
    only with skip_special_tokens=False (vLLM's switch)."""
    params = greedy(24, ignore_eos=True, stop_token_ids=[])
    prompt = [{"role": "user", "content": "Say hi."}]
    [plain] = engine.generate(prompt, params)
    [shown] = engine.generate(prompt, msgspec.structs.replace(params, skip_special_tokens=False))
    assert shown.token_ids == plain.token_ids
    special = engine.tokenizer.convert_ids_to_tokens(plain.token_ids)
    assert "<|im_end|>" in special  # the model ended its turn and went on
    assert "<|im_end|>" in shown.text and "<|im_end|>" not in plain.text
