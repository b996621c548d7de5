"""Penalties and logit_bias: what vLLM and OpenAI define, per request, batch-invariant."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_idle_accounting, greedy, user
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.model.logit_adjust import adjust_logits

VOCAB = 8


def test_each_adjustment_is_the_documented_arithmetic_on_its_own_row() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0, 0, 0, 0]] * 2)
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                       logit_bias={3: -1.0}),
        SamplingParams(),
    ]
    prompts = [[0], [0]]
    outputs = [[1, 2, 2], [1, 2, 2]]
    out = adjust_logits(logits, params, prompts, outputs)
    # bias: token 3 -> -0.5; repetition over prompt + output (tokens 0, 1, 2): positive / 2,
    # negative * 2; then frequency (count) and presence over the output only.
    expected = torch.tensor([2.0 / 2, -2.0 * 2 - 0.5 - 0.25, 1.0 / 2 - 1.0 - 0.25, -0.5, 0, 0, 0, 0])
    assert torch.equal(out[0], expected)
    assert torch.equal(out[1], logits[1])  # a row without adjustments is untouched
    assert torch.equal(logits[0], torch.tensor([2.0, -2.0, 1.0, 0.5, 0, 0, 0, 0]))  # a copy


def test_a_logit_bias_of_minus_100_bans_the_greedy_token(engine) -> None:
    prompt = user("Count from one to ten.")
    [plain] = engine.generate(prompt, greedy(8))
    first = plain.token_ids[0]
    [banned] = engine.generate(prompt, greedy(8, logit_bias={first: -100.0}))
    assert first not in banned.token_ids


def test_a_logit_bias_of_plus_100_forces_a_token(engine, tokenizer) -> None:
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    [out] = engine.generate(user("Hi"), greedy(4, logit_bias={forced: 100.0}, ignore_eos=True))
    assert out.token_ids == [forced] * 4


def test_frequency_and_presence_penalties_cut_repetition(engine) -> None:
    prompt = "one one one one one one one one one one one one one one one one"
    [plain] = engine.generate(prompt, greedy(24, ignore_eos=True))
    [penalised] = engine.generate(
        prompt, greedy(24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    )
    assert len(set(penalised.token_ids)) > len(set(plain.token_ids))
    [repeat] = engine.generate(prompt, greedy(24, ignore_eos=True, repetition_penalty=1.8))
    assert repeat.token_ids != plain.token_ids


def test_penalised_greedy_answers_do_not_depend_on_the_batch(engine) -> None:
    prompts = [user(q) for q in ("Name a fruit.", "Describe rain.", "Say hello.", "Why?")]
    params = [
        greedy(16, frequency_penalty=1.0),
        greedy(16, presence_penalty=1.5, logit_bias={13: -5.0}),
        greedy(16, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, frequency_penalty=0.7),
    ]
    alone = [engine.generate(p, s)[0].token_ids for p, s in zip(prompts, params)]
    batched = [o.token_ids for o in engine.generate(prompts, params)]
    assert batched == alone
    assert_idle_accounting(engine)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty: must be a number in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty: must be a number in \(0, 10\]"),
        ({"logit_bias": {1: 101.0}}, r"logit_bias\[1\]: must be a number in \[-100, 100\]"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias: keys must be token ids >= 0"),
    ],
)
def test_bad_penalties_are_value_errors_naming_the_field(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused_at_submit(engine) -> None:
    with pytest.raises(ValueError, match=r"params.logit_bias: 1000000 is not a token id"):
        engine.submit("hi", greedy(2, logit_bias={10**6: 1.0}))


def _reference(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]):
    """The definitions, one token at a time."""
    row = row.clone()
    for t, b in p.logit_bias.items():
        row[t] += b
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        if p.frequency_penalty or p.presence_penalty:
            row[t] = row[t] - (p.frequency_penalty * output.count(t) + p.presence_penalty)
    return row


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.5, -1.25, 2.0]),
            st.sampled_from([0.0, 1.0, -0.5]),
            st.sampled_from([1.0, 1.5, 0.8]),
            st.dictionaries(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, 3.5]), max_size=3),
            st.lists(st.integers(0, VOCAB - 1), max_size=6),
            st.lists(st.integers(0, VOCAB - 1), max_size=6),
        ),
        min_size=1, max_size=4,
    ),
    seed=st.integers(0, 2**16),
)
def test_adjusted_rows_follow_the_definitions_and_ignore_their_batch(rows, seed) -> None:
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed))
    params = [SamplingParams(frequency_penalty=f, presence_penalty=pr, repetition_penalty=r,
                             logit_bias=b) for f, pr, r, b, _, _ in rows]
    prompts = [prompt for *_, prompt, _ in rows]
    outputs = [output for *_, output in rows]
    batched = adjust_logits(logits, params, prompts, outputs)
    for i in range(len(rows)):
        alone = adjust_logits(logits[i : i + 1], params[i : i + 1], prompts[i : i + 1],
                              outputs[i : i + 1])
        assert torch.equal(batched[i], alone[0])
        assert torch.equal(batched[i], _reference(logits[i], params[i], prompts[i], outputs[i]))
