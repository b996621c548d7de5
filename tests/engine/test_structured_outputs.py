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


FIGURES = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "adult": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["tall", "kind", "old"]}, "maxItems": 3},
    },
    "required": ["age", "adult", "tags"],
    "additionalProperties": False,
}


def test_json_is_laid_out_as_tool_calls_are_unless_the_schema_says_otherwise(engine) -> None:
    """A space after ", " and ": ", no other whitespace: left free, the model spent tokens
    on newlines between keys. A schema's own x-guidance layout still wins."""
    outs = engine.generate(ASKS[:2], constrained(json=FIGURES))
    for out in outs:
        assert out.text == json.dumps(json.loads(out.text)), out.text
    compact = {**FIGURES, "x-guidance": {"whitespace_flexible": False, "item_separator": ",",
                                         "key_separator": ":"}}
    [out] = engine.generate(ASKS[0], constrained(json=compact))
    assert out.text == json.dumps(json.loads(out.text), separators=(",", ":")), out.text


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


def test_draft_rows_are_masked_as_the_grammar_stands_after_the_drafts_before_them(
    tokenizer,
) -> None:
    """Row j of a drafted request gets the mask its matcher computes after the first j draft
    tokens; rows after a draft token the grammar refuses are left free (the row before bans
    that token, so nothing past it is accepted); the matcher itself does not move."""
    import numpy as np
    import torch
    from llguidance import LLMatcher

    from engine.model.structured import Grammars
    from scheduler.request import Request

    grammars = Grammars(tokenizer)
    spec = Structured(json=PERSON)
    request = Request(0, [1, 2, 3], greedy(40, structured_outputs=spec))
    free = Request(1, [1, 2, 3], greedy(40))
    text = '{"name": "Ada", "age": 36, "city": "London"}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    request.output = ids[:2]
    # '{"name' then '":' and a '}' where the key's value must begin: refused.
    good, refused = ids[2:7], ids[2:3] + tokenizer.encode("}", add_special_tokens=False) + ids[4:6]
    vocab = tokenizer.vocab_size

    def expected(draft: list[int]) -> list[np.ndarray]:
        matcher = LLMatcher(grammars.tokenizer, grammars.check(spec))
        matcher.consume_tokens(request.output)
        masks = []
        for j in range(len(draft) + 1):
            words = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
            bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
            masks.append(bits.astype(bool))
            if j < len(draft) and not matcher.consume_token(draft[j]):
                break
        return masks

    for draft in (good, refused):
        rows = 1 + len(draft) + 1  # an unconstrained request's row, then this one's
        logits = torch.zeros(rows, vocab)
        masked = grammars.mask(logits, [(free, [], 0), (request, draft, 1)])
        assert bool(torch.isfinite(masked[0]).all())
        want = expected(draft)
        for j, allowed in enumerate(want):
            assert np.array_equal(torch.isfinite(masked[1 + j]).numpy(), allowed), (draft, j)
        for row in range(1 + len(want), rows):
            assert bool(torch.isfinite(masked[row]).all())
        assert len(want) == (len(draft) + 1 if draft is good else 2)
    # The matcher is where the output left it: the next mask (no drafts) is row 0's again.
    again = grammars.mask(torch.zeros(1, vocab), [(request, [], 0)])
    assert np.array_equal(torch.isfinite(again[0]).numpy(), expected([])[0])


# Grammars llguidance cannot follow (issue 47, finding 5). Before, each of these ended "stop"
# with text outside its grammar: llguidance puts a matcher that hits one of its limits in an
# error state whose mask allows EOS alone, and only logs it.
CHOICES = [f"opt{i}" for i in range(5000)]
WIDE_RULE = "start: " + " | ".join(f'"w{i}"' for i in range(2500))  # a row of 2,500 items
# Three free choices, then a rule of 2,001 alternatives: the row limit is hit mid-request.
LATE_LIMIT = ('start: ("red" | "blue") ";" ("cat" | "dog") ";" ("one" | "two") ";" big\n'
              "big: " + " | ".join(f'"o{i}"' for i in range(2001)))


def test_a_choice_of_thousands_of_alternatives_is_followed(engine) -> None:
    """A choice is one lexeme, not a parser rule that llguidance bounds at 2,000 items
    (5,000 choices gave "opt", which is none of them)."""
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True,
                            structured_outputs=Structured(choice=CHOICES))
    [out] = engine.generate(user("Pick an option."), params)
    assert out.text in CHOICES and out.finish_reason == "stop", out.text


def test_a_json_enum_of_20000_strings_keeps_working(engine) -> None:
    enum = [f"s{i}" for i in range(20000)]
    [out] = engine.generate(user("Pick a string."), constrained(20, json={"enum": enum}))
    assert json.loads(out.text) in enum and out.finish_reason == "stop", out.text


@pytest.mark.parametrize(
    "spec",
    [
        {"grammar": WIDE_RULE},  # over llguidance's 2,000 items per row
        {"grammar": 'start: "a" start'},  # no finite string satisfies these
        {"grammar": 'start: "(" start ")"'},
        {"regex": r"[^\s\S]"},  # matches nothing
    ],
    ids=["wide-rule", "endless", "endless-nested", "empty-regex"],
)
def test_a_grammar_llguidance_cannot_follow_is_refused_at_submit(engine, spec) -> None:
    before = engine.stats().counters.requests
    kind = next(iter(spec))
    with pytest.raises(ValueError, match=rf"params.structured_outputs.{kind}: cannot be followed"):
        engine.submit("hi", SamplingParams(ignore_eos=True, structured_outputs=Structured(**spec)))
    assert engine.stats().counters.requests == before


def test_a_grammar_that_stops_the_matcher_mid_request_fails_it_never_stops(engine) -> None:
    """The submission probe looks one token past the first branch; a limit hit later fails
    the request with the reason (a 400 over HTTP), never "stop" with text outside it."""
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True,
                            structured_outputs=Structured(grammar=LATE_LIMIT))
    with pytest.raises(ValueError, match=r"structured_outputs: the grammar could not be followed"):
        engine.generate(user("Pick."), params)
    assert_idle_accounting(engine)
