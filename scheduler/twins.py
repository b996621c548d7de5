"""Requests whose next rows are the same rows: computed once, copied to the others.

Two decoding requests of one namespace with the same prompt and the same output so far, whose
sampling is a function of those tokens alone (greedy, or seeded with the same seed: the noise is
keyed by the token's index in the output) and the same sampling knobs, get the same logits from
a batch-invariant pass and so the same next tokens, and write the same K/V. That happens
whenever identical requests are in flight together: ``n`` greedy choices, a client's retry
while the first attempt still runs, one FAQ question from many users. All but one of their
rows are wasted. A request whose tokens so far are a prefix of another's (it started later,
or waited for that one's prefill to hit its prefix) becomes its twin: its entry feeds the
other's tokens from its own position to the end of the other's entry this step
(``BatchEntry.twin_of``), and the runner copies the other's K/V for those positions into its
slots and gives it the other's tokens, so it catches up in one step and keeps step after. How
each request finishes (``max_new_tokens``, stops) stays its own.
"""

from __future__ import annotations

import msgspec

from scheduler.params import SamplingParams
from scheduler.request import Request


def sampling_key(params: SamplingParams) -> SamplingParams | None:
    """What decides a request's next token besides its tokens (its finishing knobs and its
    prompt's scores, done before it decodes, cleared), or None where its rows cannot stand
    for another's: unseeded sampling, log-probabilities (per-request results), structured
    outputs (a matcher per request), ``min_tokens`` (its stop tokens are masked by count)."""
    if (not params.is_greedy and params.seed is None) or params.logprobs is not None:
        return None
    if params.structured_outputs is not None or params.min_tokens:
        return None
    return msgspec.structs.replace(
        params, max_new_tokens=1, stop=[], stop_token_ids=[], prompt_logprobs=None,
        include_stop_str_in_output=False, skip_special_tokens=True,
    )


def twin_key(request: Request) -> tuple[object, ...] | None:
    """What requests that can stand for each other share, as a dict key: namespace and prompt
    (hashed; prompts and sampling are compared by ``follows``); None where the request cannot
    be a twin. Made once per request (its prompt and params never change)."""
    if sampling_key(request.params) is None:
        return None
    return (request.namespace, hash(tuple(request.prompt)))


def follows(behind: Request, ahead: Request) -> bool:
    """For two requests of one ``twin_key``: whether ``behind``'s tokens so far are a prefix
    of ``ahead``'s and their sampling is the same, so that ``ahead``'s rows (K/V and tokens,
    computed already or in this step) are ``behind``'s."""
    n, m = len(behind.output), len(ahead.output)
    if n > m or behind.prompt != ahead.prompt:
        return False
    # In step (the usual case) the outputs compare whole; only a request behind slices.
    if behind.output != (ahead.output if n == m else ahead.output[:n]):
        return False
    a, b = behind.params, ahead.params  # n choices share one params object: no key made
    return a is b or a == b or sampling_key(a) == sampling_key(b)
