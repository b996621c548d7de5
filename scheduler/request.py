"""A request as the scheduler sees it: its tokens, what it asked for, and where its KV lives."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from radix import CacheHandle
from scheduler.params import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and requeued)
    RUNNING = "running"  # admitted: holds a CacheHandle, prefilling or decoding
    FINISHED = "finished"  # a stop token, a stop string, or max_new_tokens
    ABORTED = "aborted"  # aborted by the caller or failed; holds nothing


@dataclass(eq=False)
class Request:
    """One generation request.

    The caller sets the first five fields; the scheduler owns the rest. ``eos_token_ids`` are
    the model's end-of-sequence ids, which end the request unless ``params.ignore_eos``.
    """

    id: int | str
    prompt: list[int]
    params: SamplingParams
    namespace: str | None = None
    eos_token_ids: frozenset[int] = frozenset()

    state: RequestState = RequestState.WAITING
    output: list[int] = field(default_factory=list)
    # Tokens served from the tree at first admission (what RequestOutput.cached_tokens reports).
    cached_tokens: int = 0
    # Of cached_tokens, those loaded back from below the pool (host memory, disk).
    cached_tokens_below: int = 0
    # Tokens of prompt + output whose K/V is written in the handle's pages.
    num_computed: int = 0
    # Where its KV lives while it runs (None while waiting and once ended).
    kv: CacheHandle | None = None
    arrival: int = 0  # arrival order, set by Scheduler.add
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None  # first admission (queue time = this - arrival_time)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    num_preemptions: int = 0
    # Set at first admission: counters count a prompt (and its cached part) once.
    admitted: bool = False
    # Prompt positions whose next token's log-probability was computed (prompt_logprobs):
    # positions 0 .. scored - 1, never computed twice (preemption recomputes, not rescores).
    scored: int = 0

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def all_tokens(self) -> list[int]:
        """Prompt and output (the prompt itself while nothing was generated)."""
        return self.prompt + self.output if self.output else self.prompt

    @property
    def is_prefilling(self) -> bool:
        """True while some prompt tokens (or, after preemption, output tokens) lack K/V."""
        return self.num_computed < self.num_tokens - (1 if self.output else 0)

    @property
    def scores_prompt(self) -> bool:
        """Some prompt token's log-probability (``params.prompt_logprobs``) is still owed:
        positions ``scored .. len(prompt) - 2`` must be computed, not taken from the cache."""
        return self.params.prompt_logprobs is not None and self.scored < len(self.prompt) - 1

    @property
    def is_done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    def stop_tokens(self) -> set[int]:
        """The tokens that would end this request: its stop ids, and EOS unless ignored."""
        params = self.params
        ignore_eos = params.ignore_eos and params.structured_outputs is None
        return {*params.stop_token_ids, *(() if ignore_eos else self.eos_token_ids)}

    def is_stop_token(self, token: int) -> bool:
        """True if ``token`` ends this request (its text is then not part of the reply).
        ``ignore_eos`` does not hold under structured outputs: their grammar allows EOS only
        where the structure may end, and after it nothing but EOS."""
        params = self.params
        ignore_eos = params.ignore_eos and params.structured_outputs is None
        return token in params.stop_token_ids or (
            not ignore_eos and token in self.eos_token_ids
        )

    def end_reason(self, token: int, generated: int, stop_string: bool = False) -> str | None:
        """Whether ``token``, the ``generated``-th output token, ends the request, and why:
        the one rule, read by the engine loop (which tokens of a step reach the reply) and by
        ``Scheduler.commit`` (which ends the request). ``stop_string``: the reply's text with
        it holds a stop string."""
        if stop_string or self.is_stop_token(token):
            return "stop"
        if generated >= self.params.max_new_tokens:
            return "length"
        return None

    def finish_reason_after(self, token: int, stop_string: bool = False) -> str | None:
        """``end_reason`` of the token just appended to ``output``."""
        return self.end_reason(token, len(self.output), stop_string)
