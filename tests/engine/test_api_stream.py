"""Streaming: deltas add up to the final text; stop strings end the request, stay out of the
text, and never show up even partially in the stream."""

from __future__ import annotations

from engine_helpers import assert_idle_accounting, greedy

from engine.api import RequestOutput

PROMPT = "The capital of France"


def _collect(stream) -> tuple[list[str], RequestOutput]:
    items = list(stream)
    final = items.pop()
    assert isinstance(final, RequestOutput)
    assert all(isinstance(d, str) and d for d in items)
    return items, final


def test_deltas_concatenate_to_the_final_text(engine, tokenizer, hf_greedy) -> None:
    deltas, final = _collect(engine.stream(PROMPT, greedy(16)))
    assert "".join(deltas) == final.text
    assert final.token_ids == hf_greedy(tokenizer.encode(PROMPT), 16)
    assert final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert final.finish_reason == "length"
    assert final.ttft_s is not None and 0 <= final.ttft_s <= final.latency_s


def test_stop_string_ends_the_request_and_is_excluded(engine, tokenizer) -> None:
    _, full = _collect(engine.stream(PROMPT, greedy(16)))
    assert "Paris" in full.text
    cut = full.text.index("Paris")
    deltas, final = _collect(engine.stream(PROMPT, greedy(16, stop=["Paris", "zebra"])))
    assert final.finish_reason == "stop"
    assert final.text == full.text[:cut]
    assert "".join(deltas) == final.text
    assert not any("P" in d for d in deltas)  # no piece of the stop string leaked
    # Generation stopped at the token that completed the stop string.
    assert len(final.token_ids) < len(full.token_ids)
    assert "Paris" in tokenizer.decode(final.token_ids)
    assert_idle_accounting(engine)


def test_stop_string_spanning_tokens(engine) -> None:
    [full] = engine.generate(PROMPT, greedy(16))
    stop = full.text[2:7]  # straddles token boundaries
    [out] = engine.generate(PROMPT, greedy(16, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]


def test_stop_token_id_ends_the_request_and_its_text_is_excluded(engine, tokenizer) -> None:
    [full] = engine.generate(PROMPT, greedy(16))
    at = next(k for k in range(2, 16) if full.token_ids[k] not in full.token_ids[:k])
    [out] = engine.generate(PROMPT, greedy(16, stop_token_ids=[full.token_ids[at]]))
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: at + 1]
    assert out.text == tokenizer.decode(full.token_ids[:at])


def test_eos_ends_a_chat_reply_unless_ignored(engine) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    [out] = engine.generate(messages, greedy(40))
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in engine.model_config.eos_token_ids
    assert "<|im_end|>" not in out.text
    [ignored] = engine.generate(messages, greedy(len(out.token_ids) + 2, ignore_eos=True))
    assert ignored.finish_reason == "length"
    assert len(ignored.token_ids) == len(out.token_ids) + 2
