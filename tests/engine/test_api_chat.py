"""Chat sessions: each turn starts with exactly the previous turn's prompt + reply tokens, so it
hits the cache for the whole previous conversation."""

from __future__ import annotations

from engine_helpers import greedy

from engine.api import RequestOutput
from engine.serving.conversation import continue_tokens

TURNS = [
    "Hi! Who are you?",
    "Name a fruit that is yellow.",
    "What colour is the sky on a clear day?",
    "Thanks, goodbye!",
]


def test_four_turn_session_reuses_previous_conversation(engine, hf_greedy) -> None:
    page = engine.page_size
    session = engine.chat(system="You are a concise assistant.", params=greedy(16))
    previous: list[int] = []
    for turn, text in enumerate(TURNS):
        reply = session.send(text)
        out = session.last_output
        assert isinstance(out, RequestOutput) and reply == out.text
        prompt = session.token_ids[: out.prompt_tokens]
        # The prompt starts with exactly the tokens of the previous prompt + reply.
        assert prompt[: len(previous)] == previous
        assert session.last_dropped_tokens == 0
        # Same tokens as transformers' greedy generate for this exact prompt.
        assert out.token_ids == hf_greedy(prompt, 16)
        if turn > 0:
            # K/V exists for every previous token but the last one sampled (never fed back).
            assert out.cached_tokens >= (len(previous) - 1) // page * page
            assert out.cached_tokens > 0
        previous = session.token_ids
    assert len(session.messages) == 1 + 2 * len(TURNS)
    assert [m["role"] for m in session.messages[1:3]] == ["user", "assistant"]


def test_session_text_matches_the_chat_template(engine, tokenizer) -> None:
    session = engine.chat(params=greedy(8))
    session.send("Say hello.")
    session.send("Say goodbye.")
    rendered = tokenizer.apply_chat_template(
        session.messages[:-1], tokenize=False, add_generation_prompt=True
    )
    out = session.last_output
    prompt_text = tokenizer.decode(
        session.token_ids[: out.prompt_tokens], skip_special_tokens=False
    )
    assert prompt_text == rendered


def test_forked_sessions_branch_and_share_history(engine) -> None:
    base = engine.chat(params=greedy(8))
    base.send("Pick a number between one and ten.")
    left, right = base.fork(), base.fork()
    left.send("Double it.")
    right.send("Halve it.")
    history = base.token_ids
    shared = len(base.messages)
    assert left.messages[:shared] == base.messages == right.messages[:shared]
    assert left.messages[-2]["content"] == "Double it."
    assert right.messages[-2]["content"] == "Halve it."
    for branch in (left, right):
        assert branch.token_ids[: len(history)] == history
        assert branch.last_output.cached_tokens >= (len(history) - 1) // 16 * 16
    assert len(base.messages) == 2  # the original is untouched: one user, one assistant


def test_streamed_turn_is_recorded_and_closed_turn_is_not(engine) -> None:
    session = engine.chat(params=greedy(8))
    items = list(session.stream("Hello there"))
    assert isinstance(items[-1], RequestOutput)
    assert "".join(items[:-1]) == items[-1].text
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    turn = session.stream("Tell me a long story about dragons.", greedy(50, ignore_eos=True))
    next(turn)
    turn.close()
    assert len(session.messages) == 2


def test_continue_tokens_keeps_previous_tokens_when_text_diverges(tokenizer) -> None:
    previous = tokenizer.encode("Hello world, this is", add_special_tokens=False)
    # The new text drops the last word: only the tokens whose text is still a prefix survive.
    ids, reused = continue_tokens(tokenizer, previous, "Hello world, thus it goes")
    assert reused < len(previous)
    assert ids[:reused] == previous[:reused]
    assert tokenizer.decode(ids) == "Hello world, thus it goes"
    ids, reused = continue_tokens(tokenizer, previous, "Hello world, this is fine")
    assert reused == len(previous) and tokenizer.decode(ids) == "Hello world, this is fine"
