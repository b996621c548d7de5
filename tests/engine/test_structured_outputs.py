"""Structured outputs in the engine: every output matches its grammar, alone, batched, after
preemption and across n choices; a grammar that cannot compile is refused at submit."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from engine_helpers import assert_idle_accounting, greedy, user

from engine import SamplingParams
from engine import StructuredOutputsParams as Structured

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASKS = [user(f"Describe person number {i} as JSON with name, age and city.") for i in range(4)]


def constrained(max_new_tokens: int = 80, **kwargs) -> SamplingParams:
    return greedy(max_new_tokens, structured_outputs=Structured(**kwargs))


def test_json_schema_outputs_validate(engine) -> None:
    outs = engine.generate(ASKS, constrained(json=PERSON))
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    assert_idle_accounting(engine)


def test_regex_choice_grammar_and_json_object_match(engine) -> None:
    [phone] = engine.generate("My phone number is", constrained(regex=r"\d{3}-\d{4}"))
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text)
    [answer] = engine.generate(user("Is the sky green?"), constrained(choice=["yes", "no"]))
    assert answer.text in ("yes", "no")
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/'
    [lark] = engine.generate(user("What is 6 times 7?"), constrained(grammar=grammar))
    assert re.fullmatch(r"The answer is [0-9]+\.", lark.text)
    ask = user("Give me a JSON object with one key, 'colour', set to a colour.")
    [anything] = engine.generate(ask, constrained(json_object=True))
    assert anything.finish_reason == "stop" and isinstance(json.loads(anything.text), dict)


def test_constrained_greedy_answers_do_not_depend_on_the_batch(engine) -> None:
    params = [constrained(json=PERSON), greedy(40), constrained(choice=["red", "green"]),
              constrained(regex=r"[a-z]{3,8}")]
    alone = [engine.generate(a, p)[0].token_ids for a, p in zip(ASKS, params)]
    batched = [o.token_ids for o in engine.generate(ASKS, params)]
    assert batched == alone


def test_preempted_constrained_requests_resume_where_their_grammar_was(
    engine, make_engine
) -> None:
    expected = [o.text for o in engine.generate(ASKS * 2, constrained(json=PERSON))]
    tight = make_engine(
        page_size=4, num_pages=40,
        reserve_ratio_init=0.0, reserve_margin=0.0, reserve_ratio_min=0.0,
    )
    outs = tight.generate(ASKS * 2, constrained(json=PERSON))
    assert tight.stats().counters.preemptions > 0
    assert [o.text for o in outs] == expected
    assert_idle_accounting(tight)


def test_each_of_n_seeded_choices_is_valid(engine) -> None:
    params = [
        SamplingParams(max_new_tokens=80, temperature=1.0, seed=s,
                       structured_outputs=Structured(json=PERSON))
        for s in range(4)
    ]
    outs = engine.generate([ASKS[0]] * 4, params)
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({o.text for o in outs}) > 1  # four draws, not one answer four times


def test_a_request_cut_by_length_ends_mid_structure_with_finish_reason_length(engine) -> None:
    [out] = engine.generate(ASKS[0], constrained(max_new_tokens=5, json=PERSON))
    assert out.finish_reason == "length" and out.text.startswith("{")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"regex": "a("}, r"params.structured_outputs.regex: cannot compile"),
        ({"grammar": "start: undefined_rule"}, r"params.structured_outputs.grammar: cannot compile"),
        ({"json": "{not json"}, r"params.structured_outputs.json: "),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_at_submit(engine, spec, match) -> None:
    before = engine.stats().counters.requests
    with pytest.raises(ValueError, match=match):
        engine.submit("hi", SamplingParams(structured_outputs=Structured(**spec)))
    assert engine.stats().counters.requests == before


def test_a_spec_must_name_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match=r"structured_outputs: give exactly one of"):
        Structured(regex="a", choice=["b"])
    with pytest.raises(ValueError, match=r"structured_outputs: give exactly one of"):
        Structured()


def test_a_complete_structure_ends_the_request_even_with_ignore_eos(engine) -> None:
    params = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True,
                            structured_outputs=Structured(choice=["yes", "no"]))
    [out] = engine.generate(user("Is the sky blue?"), params)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
