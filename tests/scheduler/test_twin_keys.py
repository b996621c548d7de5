"""Which requests may stand for each other (``scheduler/twins.py``): one namespace, one prompt,
sampling that is a function of the tokens; finishing knobs aside."""

from __future__ import annotations

from scheduler import Request, SamplingParams
from scheduler.params import StructuredOutputsParams
from scheduler.twins import follows, twin_key

PROMPT = [5, 6, 7, 8]


def key(params: SamplingParams, namespace: str | None = None, prompt: list[int] = PROMPT) -> object:
    return twin_key(Request("r", list(prompt), params, namespace))


def test_greedy_and_seeded_requests_have_keys_that_ignore_how_they_finish() -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    assert key(greedy) is not None
    assert key(greedy) == key(SamplingParams(temperature=0.0, max_new_tokens=64, stop=["x"],
                                             stop_token_ids=[3]))
    seeded = SamplingParams(temperature=0.7, seed=1)
    assert key(seeded) is not None and key(seeded) != key(greedy)
    assert key(seeded) != key(SamplingParams(temperature=0.7, seed=2))
    assert key(seeded) != key(SamplingParams(temperature=0.7, seed=1, top_p=0.5))


def test_no_key_where_rows_cannot_stand_for_another_request() -> None:
    assert key(SamplingParams(temperature=0.7)) is None  # unseeded: a draw of its own
    assert key(SamplingParams(temperature=0.0, logprobs=2)) is None
    schema = StructuredOutputsParams(json={"type": "object"})
    assert key(SamplingParams(temperature=0.0, structured_outputs=schema)) is None


def test_keys_part_namespaces_and_prompts() -> None:
    greedy = SamplingParams(temperature=0.0)
    assert key(greedy, "a") != key(greedy, "b") != key(greedy)
    assert key(greedy, prompt=[5, 6, 7, 9]) != key(greedy)


def test_a_request_follows_one_whose_tokens_extend_its_own() -> None:
    params = SamplingParams(temperature=0.0)
    ahead, behind = Request("a", list(PROMPT), params), Request("b", list(PROMPT), params)
    ahead.output, behind.output = [1, 2, 3], [1, 2]
    assert follows(behind, ahead) and not follows(ahead, behind)
    behind.output = [1, 4]
    assert not follows(behind, ahead)
    behind.output = [1, 2, 3]
    assert follows(behind, ahead) and follows(ahead, behind)
