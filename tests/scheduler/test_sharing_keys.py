"""Which requests may share rows (``scheduler/shared_rows.py``): one namespace, one prompt,
sampling that is a function of the tokens; finishing knobs aside."""

from __future__ import annotations

import numpy as np

from scheduler import Request, SamplingParams
from scheduler.params import StructuredOutputsParams
from scheduler.shared_rows import follows, sharing_key

PROMPT = [5, 6, 7, 8]


def key(params: SamplingParams, namespace: str | None = None, prompt: list[int] = PROMPT) -> object:
    return sharing_key(Request("r", list(prompt), params, namespace))


def same_rows(a: SamplingParams, b: SamplingParams) -> bool:
    """Whether requests with one prompt, one output and these params may share rows."""
    first, second = Request("a", list(PROMPT), a), Request("b", list(PROMPT), b)
    return sharing_key(first) is not None and sharing_key(first) == sharing_key(second) and follows(
        second, first)


def test_greedy_and_seeded_requests_pair_whatever_their_finishing_knobs() -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    assert same_rows(greedy, SamplingParams(temperature=0.0, max_new_tokens=64, stop=["x"],
                                            stop_token_ids=[3]))
    seeded = SamplingParams(temperature=0.7, seed=1)
    assert same_rows(seeded, SamplingParams(temperature=0.7, seed=np.int64(1)))
    assert not same_rows(seeded, greedy)
    assert not same_rows(seeded, SamplingParams(temperature=0.7, seed=2))
    assert not same_rows(seeded, SamplingParams(temperature=0.7, seed=1, top_p=0.5))
    # Params may hold numpy integers (accepted wherever ints are): still a key.
    assert key(SamplingParams(temperature=0.0, logit_bias={np.uint32(5): 1.0})) is not None


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
