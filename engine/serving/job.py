"""One request as the serving side keeps it: its text, its timings, its caller's sink.

The scheduler sees only the ``Request``; everything per caller rides here. A job takes the
tokens a step produced for it (up to the first that ends it), turns them into the deltas a
stream sends, and builds the ``RequestOutput`` its caller gets: what the loop used to
assemble by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.api import Delta, HandleSink, RequestHandle, RequestOutput, TokenLogprob
from engine.serving.detokenizer import IncrementalDetokenizer
from scheduler import Request


@dataclass(eq=False)
class Job:
    """A request and what the serving side keeps with it."""

    request: Request
    detokenizer: IncrementalDetokenizer
    sink: HandleSink  # where the caller's handle gets its deltas and its end
    stream: bool  # deliver text deltas, not only the final output
    # Pin the request's tokens for this many seconds once it finishes (a stored conversation
    # that should stay warm for its next turn); None: no pin.
    pin_ttl: float | None = None
    # Log-probabilities of every generated token (requests that asked), and when each came.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Log-probabilities of the prompt's tokens after the first (requests that asked).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    # Tokens generated since the last delta (their text may still be held back).
    unsent: int = 0
    delivered: bool = False  # a delta went out (the first carries the prompt's scores)

    @classmethod
    def open(
        cls,
        request: Request,
        tokenizer: Any,
        abort: Callable[[Any], None],
        stream: bool = False,
        pin_ttl: float | None = None,
    ) -> tuple[Job, RequestHandle]:
        """A job for ``request`` and the handle its caller waits on (``abort``: how the
        handle aborts it)."""
        params = request.params
        handle, sink = RequestHandle.open(request.id, abort)
        detokenizer = IncrementalDetokenizer(
            tokenizer, stop=params.stop, prompt_ids=request.prompt, min_tokens=params.min_tokens,
            include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        return cls(request, detokenizer, sink, stream, pin_ttl), handle

    def take(self, tokens: list[int], logprobs: list[TokenLogprob], now: float) -> tuple[int, str]:
        """Feeds a step's tokens to the detokeniser, up to the first that ends the request by
        ``Request.end_reason`` (a follower catching up is given its leader's tokens, which
        may run past its own limit). Returns how many were taken and their text; the
        detokeniser's ``stopped`` then says whether a stop string ended it."""
        request = self.request
        text = []
        taken = 0
        for index, token in enumerate(tokens):
            taken += 1
            self.token_times.append(now)
            self.unsent += 1
            if index < len(logprobs):
                self.logprobs.append(logprobs[index])
            if not request.is_stop_token(token):  # a stop token's text is not in the reply
                text.append(self.detokenizer.push(token))
            generated = len(request.output) + taken
            if request.end_reason(token, generated, self.detokenizer.stopped) is not None:
                break
        return taken, "".join(text)

    def delta(self, text: str) -> Delta:
        """A delta with ``text`` and the tokens (and log-probabilities) not yet sent."""
        n, self.unsent = self.unsent, 0
        ids = self.request.output[len(self.request.output) - n :]
        lps = self.logprobs[len(self.logprobs) - n :] if self.logprobs else []
        scores = None
        if not self.delivered:
            self.delivered = True
            scores = self.prompt_scores()
        return Delta(text, tuple(ids), tuple(lps), None if scores is None else tuple(scores))

    def prompt_scores(self) -> list[TokenLogprob | None] | None:
        """The prompt's log-probabilities, None first (nothing predicts the first token);
        None if the request did not ask for them."""
        if self.request.params.prompt_logprobs is None:
            return None
        return [None, *self.prompt_logprobs]

    def output(self, now: float) -> RequestOutput:
        """The caller's output: the request finished, or was aborted (``now``)."""
        request = self.request
        first = request.first_token_time
        end = request.finish_time if request.finish_time is not None else now
        admitted = request.admitted_time
        times = self.token_times
        return RequestOutput(
            text=self.detokenizer.text,
            token_ids=list(request.output),
            finish_reason=request.finish_reason or "abort",
            prompt_tokens=len(request.prompt),
            cached_tokens=request.cached_tokens,
            ttft_s=None if first is None else first - request.arrival_time,
            latency_s=end - request.arrival_time,
            queue_s=None if admitted is None else admitted - request.arrival_time,
            itl_s=[b - a for a, b in zip(times, times[1:])],
            logprobs=self.logprobs if request.params.logprobs is not None else None,
            prompt_logprobs=self.prompt_scores(),
        )

    @property
    def pins_at_finish(self) -> bool:
        """Whether its tokens are to be pinned now: it asked, and it finished (not aborted)."""
        return self.pin_ttl is not None and self.request.finish_reason not in (None, "abort")
