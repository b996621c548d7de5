from __future__ import annotations

import pytest

from workloads.traces.ideal import ideal_cached_tokens, ideal_hit_rate


def test_first_request_has_nothing_to_hit():
    assert ideal_cached_tokens([(list(range(40)), [])], page_size=4) == [0]


def test_repeat_prompt_hits_all_whole_pages_but_the_last_token():
    prompt = list(range(40))
    # 40 tokens, page 4: the cap is the page-aligned part of 39 tokens = 36.
    assert ideal_cached_tokens([(prompt, []), (prompt, [])], page_size=4) == [0, 36]


def test_match_rounds_down_to_a_page():
    a = list(range(20))
    b = list(range(10)) + [99] * 10  # shares 10 tokens: 2 whole pages of 4
    assert ideal_cached_tokens([(a, []), (b, [])], page_size=4) == [0, 8]


def test_earlier_output_counts_as_cached():
    first = list(range(8))
    output = [100, 101, 102, 103, 104, 105]
    second = first + output + [7, 7, 7]  # next turn carries the reply
    assert ideal_cached_tokens([(first, output), (second, [])], page_size=2) == [0, 14]


def test_partial_last_page_of_earlier_request_is_not_cached():
    first = list(range(10))  # pages of 4: only 8 tokens are cached
    second = list(range(10)) + [50, 51, 52]
    assert ideal_cached_tokens([(first, []), (second, [])], page_size=4) == [0, 8]


def test_best_of_all_earlier_requests_is_used():
    a = [1] * 8 + [2] * 8
    b = [1] * 8 + [3] * 8
    c = [1] * 8 + [3] * 4 + [9] * 4
    assert ideal_cached_tokens([(a, []), (b, []), (c, [])], page_size=4) == [0, 8, 12]


def test_page_size_one_matches_token_by_token():
    assert ideal_cached_tokens([([5, 6, 7, 8], []), ([5, 6, 9], [])], page_size=1) == [0, 2]


def test_hit_rate_is_cached_over_prompt_tokens():
    prompt = list(range(16))
    # second request: cap = (16 - 1) // 4 * 4 = 12 cached of 16; total 12 / 32
    assert ideal_hit_rate([(prompt, []), (prompt, [])], page_size=4) == pytest.approx(12 / 32)


def test_empty_prompt_and_bad_page_size_raise():
    with pytest.raises(ValueError, match="prompt"):
        ideal_cached_tokens([([], [])], page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        ideal_cached_tokens([([1], [])], page_size=0)
